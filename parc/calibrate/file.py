"""The calibration file `parc profile` writes (docs/cluster.md, "Calibration"): one rank's device
figures and the smallest multi-rank count's link figures at the top, k ranks' figures under
`sharing."k"`, and the raw timings as comments."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from parc.plandir.manifest import sha256_file


def _device_yaml(f: dict) -> dict:
    """A device's section of the file from its fitted fields (`fit`), in the file's units."""
    return {"fp32_tflops": f["peak_float32"] / 1e12, "bandwidth_gbs": f["memory_bandwidth"] / 1e9,
            "launch_floor_us": f["launch_floor"] * 1e6, "task_overhead_us": f["task_overhead"] * 1e6,
            "compute_efficiency": f["compute_efficiency"], "memory_efficiency": f.get("memory_efficiency", 1.0),
            **({"op_efficiency": f["op_efficiency"]} if f["op_efficiency"] else {}),
            **({"memory_op_efficiency": f["memory_op_efficiency"]} if f.get("memory_op_efficiency") else {}),
            # 0 is written too: a k-rank section laid over one rank's must not inherit its figures
            **({"node_floor_us": f["node_floor"] * 1e6} if "node_floor" in f else {}),
            **({"op_floor_us": {cls: v * 1e6 for cls, v in f["op_floor"].items()}} if f.get("op_floor") else {}),
            **({"node_piece_ns": f["node_piece"] * 1e9} if "node_piece" in f else {}),
            **({"op_piece_ns": {cls: v * 1e9 for cls, v in f["op_piece"].items()}} if f.get("op_piece") else {}),
            **({"cold_bandwidth_gbs": f["cold_bandwidth"] / 1e9, "cache_share_mib": f["cache_share"] / 2**20}
               if f.get("cold_bandwidth") else {}),
            **({"step_ratio": f["step_ratio"]} if "step_ratio" in f else {})}


def _link_yaml(f: dict) -> dict:
    """A link's section of the file from its fitted fields, in the file's units."""
    return {"latency_us": f["latency"] * 1e6, "bandwidth_gbs": f["bandwidth"] / 1e9,
            "handoff_us": f.get("link_handoff", f["handoff"]) * 1e6,  # a traced step's, else the bursts'
            "call_us": f.get("call", 0.0) * 1e6,
            **{kind: {"latency_us": lat * 1e6, "bandwidth_gbs": bw / 1e9} for kind, (lat, bw) in f.get("kinds", {}).items()},
            **({"step_ratio": f["link_step_ratio"]} if "link_step_ratio" in f else {})}


def _case_text(r: dict) -> str:
    """One measured product or convolution case for the file's comments: class, shapes, seconds."""
    return f"{r['class']} {'x'.join(map(str, r['input']))} * {'x'.join(map(str, r['weight']))}: {r['s']:.3g}"


def write_calibration(output: Path, fitted: dict[int, dict], measured: dict[int, dict], device: str,
                      link: str, engine: str = "", models: str = "", speeds: Sequence[float] = (),
                      cpus: int = 0, fitted_on: Sequence[str | Path] = ()) -> None:
    """The calibration YAML (`parc.cluster.clusterfile` reads it), atomically; `cpus`: the host's
    CPUs when its ranks ran on them (what tells `parc simulate` which counts of ranks share its
    cores: `Calibration.busy_counts`), 0 on a GPU; `fitted_on`: the `--model` files whose shapes
    the figures were measured on (their names and sha256, `fitted_on`)."""
    if any("link_step_ratio" in f for f in fitted.values()):  # a count without one must not inherit another's
        fitted = {k: {"link_step_ratio": 1.0, **f} if k > 1 and "latency" in f else f for k, f in fitted.items()}
    body: dict = {**({"cpus": cpus} if cpus else {}),
                  **({"fitted_on": [{"file": Path(m).name, "sha256": sha256_file(Path(m))} for m in fitted_on]}
                     if fitted_on else {}),
                  "devices": {device: _device_yaml(fitted[1])}}
    pair = min((k for k in fitted if k > 1 and "latency" in fitted[k]), default=None)
    if pair is not None:
        body["links"] = {link: _link_yaml(fitted[pair])}
    sharing = {}
    for k, f in sorted(fitted.items()):
        if k > 1:
            sharing[str(k)] = {"devices": {device: _device_yaml(f)},
                               **({"links": {link: _link_yaml(f)}} if "latency" in f else {})}
    if sharing:
        body["sharing"] = sharing
    head = [f"# parc profile: {platform.node()}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
            f"{engine or 'onnxruntime'}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
            "# one rank alone (devices), two ranks' links (links), and per rank when k share this host (sharing)",
            *([f"# classes measured on the models' own shapes: {models}"] if models else []),
            *([f"# the host's speed before each rank count and at the end (a fixed product, the first = 1): "
               f"{', '.join(f'{v:.2f}' for v in speeds)}"] if speeds else []),
            "# measured (seconds per node; all-reduce seconds per call):"]
    for k, rows in sorted(measured.items()):
        mem = ", ".join(f"{r['op']} {r['bytes'] >> 20} MiB: {r['s']:.3g}" for r in rows["memory"])
        mm = ", ".join(f"{'x'.join(map(str, r['shape']))}: {r['s']:.3g}" if "shape" in r else _case_text(r)
                       for r in rows["matmul"])
        head.append(f"#  {k} rank(s): floor {rows['launch_floor_s']:.3g}, run overhead {rows['task_overhead_s']:.3g}")
        head.append(f"#    memory-bound {mem}")
        head.append(f"#    MatMul {mm}")
        if rows.get("sweep"):
            head.append("#    sweep " + ", ".join(f"{r['op']} {r['bytes'] / 2**20:g} MiB: {r['s']:.3g}" for r in rows["sweep"]))
            f = fitted.get(k, {})
            if f.get("cache_bytes"):
                head.append(f"#    from the caches up to {f['cache_bytes'] / 2**20:g} MiB, {f['cache_speedup']:.2f}x memory's "
                            "rate; the rates below are memory's (`fit_cache`)")
        if rows.get("pieces"):
            head.append("#    short pieces " + ", ".join(f"{r['op']} {r['bytes'] >> 10} KiB, {r['pieces']:.0f} pieces: "
                                                        f"{r['s']:.3g}" for r in rows["pieces"]))
        if rows.get("small"):
            head.append("#    small " + ", ".join(
                f"{r['op']} {r['bytes'] >> 10} KiB: {r['s']:.3g}" if "op" in r else
                f"{'x'.join(map(str, r['shape']))}: {r['s']:.3g}" for r in rows["small"]))
        if rows.get("conv"):
            head.append("#    " + ", ".join(_case_text(r) for r in rows["conv"]))
        if rows.get("cold"):
            head.append("#    cold Add " + ", ".join(f"after writing {r['touched'] >> 20} MiB: {r['s']:.3g}"
                                                     for r in rows["cold"]))
        if "all_reduce" in rows:
            head.append("#    all_reduce (first after compute / in a burst) " + ", ".join(
                f"{r['n']} ranks {r['bytes']} B: {r['first_s']:.3g} / {r['s']:.3g}" for r in rows["all_reduce"]))
        if rows.get("split"):
            head.append("#    collectives of the reference step, every parameter split, traced (from their last arrival / "
                        "handoff charged / their figures): " + ", ".join(
                            f"{r['model']} {r['collectives']} collectives {r['measured_s']:.3g} / {r['handoff_s']:.3g} / "
                            f"{r['figures_s']:.3g}" for r in rows["split"]))
            f = fitted.get(k, {})
            if "link_handoff" in f:
                head.append(f"#    fitted on them (`fit_link_ratio`): the link's step_ratio x{f.get('link_step_ratio', 1.0):.3g} "
                            f"and handoff {f['link_handoff'] * 1e6:.3g} us (the bursts' first all-reduce: "
                            f"{f['handoff'] * 1e6:.3g} us)")
        if rows.get("steps"):
            head.append("#    reference steps (simulated / its busiest rank's compute / measured median, the host's speed "
                        "then against when these figures were measured): " + ", ".join(
                            f"{r['model']} {r['simulated_s']:.3g} / {r['compute_s']:.3g} / {r['measured_s']:.3g}"
                            + (f" at {r['host_speed']:.2f}" if "host_speed" in r else "") for r in rows["steps"]))
        if rows.get("collectives"):
            head.append("#    in a burst " + ", ".join(f"{r['kind']} {r['n']} ranks {r['bytes']} B: {r['s']:.3g}"
                                                   for r in rows["collectives"]))
    text = "\n".join(head) + "\n" + yaml.safe_dump(body, sort_keys=False)
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(output)
