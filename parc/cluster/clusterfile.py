"""Cluster files (`parc plan --cluster FILE`) and calibration files of constant overrides.

Every DeviceSpec and LinkSpec field can be set by its own name in SI units (`launch_floor:
4e-6`) or through a unit-suffixed key (`launch_floor_us: 4`); docs/cluster.md has the format.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from parc.cluster.cluster import (
    MAX_COUNT,
    Cluster,
    Node,
    check_size,
    default_inter_link,
    default_intra_link,
    default_nics,
    parse_devices,
    parse_node_devices,
)
from parc.cluster.devices import (
    DEVICE_ALIASES,
    DEVICES,
    GB,
    TFLOPS,
    DeviceSpec,
    GiB,
    dtype_key,
    lookup_device,
    normalise_device_name,
)
from parc.cluster.links import KINDS, LinkSpec, lookup_link
from parc.cluster.yamlfile import Entry, read_yaml
from parc.errors import UsageError

# YAML key -> peak dtype (values in TFLOP/s, or TOP/s for int8)
_PEAK_KEYS = {"fp64_tflops": "float64", "fp32_tflops": "float32", "tf32_tflops": "tf32",
              "fp16_tflops": "float16", "bf16_tflops": "bfloat16", "fp8_tflops": "float8", "int8_tops": "int8"}
# YAML key -> (DeviceSpec field, scale to SI). Scales below 1 divide (by 1e6 rather than times
# 1e-6), so 3.4 us is exactly 3.4e-6 s.
_DEVICE_UNITS = {"memory_gib": ("memory_bytes", GiB), "bandwidth_gbs": ("memory_bandwidth", GB),
                 "launch_floor_us": ("launch_floor", 1e-6), "task_overhead_us": ("task_overhead", 1e-6),
                 "node_floor_us": ("node_floor", 1e-6), "node_piece_ns": ("node_piece", 1e-9),
                 "cold_bandwidth_gbs": ("cold_bandwidth", GB), "cache_share_mib": ("cache_share", 2**20)}
_DEVICE_SI = ("memory_bytes", "memory_bandwidth", "launch_floor", "compute_efficiency", "memory_efficiency",
              "task_overhead", "node_floor", "node_piece", "cold_bandwidth", "cache_share", "step_ratio")
# per-class tables: YAML key -> (DeviceSpec field, scale to SI, whether a value may be 0)
_DEVICE_TABLES = {"op_efficiency": ("op_efficiency", 1.0, False),
                  "memory_op_efficiency": ("memory_op_efficiency", 1.0, False),
                  "op_floor": ("op_floor", 1.0, True), "op_floor_us": ("op_floor", 1e-6, True),
                  "op_piece": ("op_piece", 1.0, True), "op_piece_ns": ("op_piece", 1e-9, True)}
_DEVICE_KEYS = (*_PEAK_KEYS, *_DEVICE_UNITS, *_DEVICE_SI, *_DEVICE_TABLES, "peak_flops", "default_link", "gpu")
_MAY_BE_ZERO = ("launch_floor", "task_overhead", "node_floor", "node_piece")
_LINK_UNITS = {"bandwidth_gbps": ("bandwidth", 1e9 / 8), "bandwidth_gbs": ("bandwidth", GB),
               "latency_us": ("latency", 1e-6), "handoff_us": ("handoff", 1e-6), "call_us": ("call", 1e-6)}
_LINK_KEYS = (*_LINK_UNITS, "bandwidth", "latency", "handoff", "call", "step_ratio", *KINDS)
_NAME = re.compile(r"^[a-z][a-z0-9._-]*$")


@dataclass(frozen=True)
class Calibration:
    """Named-field overrides: per device type, per link, and per constants section of other parts.

    Values are in SI units under the dataclass field names; `peak_flops` overrides merge into the
    device's table. Sections under `constants` are for other parts' constant dataclasses
    (`override_fields(obj, calibration.section(name), where)`).
    """

    devices: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    links: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    constants: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    source: str = ""
    # (n, overrides) for a node of n devices sharing one host (CPU ranks): what each gets when
    # its neighbours run too (`parc profile` measures it); applied over the rest
    sharing: tuple[tuple[int, Calibration], ...] = ()
    cpus: int = 0  # the profiled host's CPUs (0: not known): which counts oversubscribe it
    # (file name, sha256) of the models whose own shapes these figures were measured on
    # (`parc profile --model`): figures meant for those models (`parc plan` warns on another)
    fitted_on: tuple[tuple[str, str], ...] = ()

    def section(self, name: str) -> dict[str, float]:
        """The overrides of constants section `name` (empty if the file has none)."""
        return dict(dict(self.constants).get(name, ()))

    def apply(self, cluster: Cluster) -> Cluster:
        """`cluster` with every device and link named here overridden."""
        devices = {name: dict(fields) for name, fields in self.devices}
        links = {name: dict(fields) for name, fields in self.links}

        def device(spec: DeviceSpec) -> DeviceSpec:
            fields = dict(devices.get(spec.name, {}))
            if "peak_flops" in fields:
                fields["peak_flops"] = {**dict(spec.peak_flops), **dict(fields["peak_flops"])}
            for table in ("op_efficiency", "memory_op_efficiency", "op_floor", "op_piece"):
                if table in fields:
                    fields[table] = {**dict(getattr(spec, table)), **dict(fields[table])}
            return override_fields(spec, fields, f"{self.source}: devices.{spec.name}")

        def link(spec: LinkSpec) -> LinkSpec:
            return override_fields(spec, links.get(spec.name, {}), f"{self.source}: links.{spec.name}")

        def shared_node(node: Node, n: int) -> Node:
            shared = self.shared(n)
            return node if shared is None else shared.apply(Cluster((node,), cluster.inter_link)).nodes[0]

        nodes = []
        for node in cluster.nodes:
            node = Node(tuple(device(d) for d in node.devices), link(node.intra_link), node.nics)
            n = len(node.devices)
            sharing = tuple((a, shared_node(node, a).devices) for a in self.busy_counts(n))
            nodes.append(dataclasses.replace(shared_node(node, n), sharing=sharing))
        return Cluster(tuple(nodes), link(cluster.inter_link))

    def busy_counts(self, n: int) -> tuple[int, ...]:
        """The measured counts below n at which a host of n ranks runs its ranks faster than with
        all n computing: where n ranks of `rank_threads(n)` threads each outnumber the host's
        `cpus`, a count from the most ranks those threads fit up to n (each of a < n ranks
        computing at once gets a larger share of the cores: `parc simulate` prices a compute
        task by how many of its host's ranks compute beside it). Empty where the ranks fit, or
        where the file does not say its host's CPUs."""
        if not self.cpus or not self.sharing:
            return ()
        fit = self.cpus // max(1, self.cpus // n)  # ranks whose threads fill the cores
        return tuple(k for k, _ in self.sharing if fit <= k < n) if n > fit else ()

    def shared(self, n: int) -> Calibration | None:
        """The overrides for a node of n devices: the measured count nearest n (the larger of
        two as near); None for one device or when nothing was measured."""
        if n <= 1 or not self.sharing:
            return None
        return min(self.sharing, key=lambda entry: (abs(entry[0] - n), -entry[0]))[1]


def override_fields(obj, overrides: Mapping[str, object], where: str):
    """A copy of dataclass `obj` with the named fields replaced; unknown names are a UsageError."""
    if not overrides:
        return obj
    names = [f.name for f in dataclasses.fields(obj) if f.name != "name"]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise UsageError(f"{where}: no constant named '{unknown[0]}' (known: {', '.join(names)})")
    try:
        return dataclasses.replace(obj, **overrides)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{where}: {e}") from None


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster file: custom device types, nodes, links, and an optional calibration."""
    doc = read_yaml(path).mapping(("devices", "nodes", "inter_link", "calibration"), required=("nodes",))
    extra = _custom_devices(doc["devices"]) if "devices" in doc else {}
    entries = doc["nodes"].list()
    if not entries:
        raise doc["nodes"].fail("expected at least one node")
    nodes: list[Node] = []
    for entry in entries:  # the shipped ports unless the file names its own network
        nodes.extend(_nodes(entry, extra, shipped="inter_link" not in doc))
        check_size(nodes, _where(entry))
    inter = _link(doc["inter_link"], "inter") if "inter_link" in doc else default_inter_link(nodes)
    cluster = Cluster(tuple(nodes), inter)
    if "calibration" in doc:
        cluster = _calibration(doc["calibration"], extra).apply(cluster)
    return cluster


def load_constants(path: str | Path, extra: Mapping[str, DeviceSpec] | None = None) -> Calibration:
    """Read a calibration file (the body of a cluster file's `calibration` section)."""
    return _calibration(read_yaml(path), extra or {})


def resolve_cluster(devices: str | None, cluster_file: str | None) -> Cluster:
    """The cluster of `parc plan`: exactly one of --devices SPEC and --cluster FILE."""
    if (devices is None) == (cluster_file is None):
        raise UsageError("give exactly one of --devices SPEC and --cluster FILE")
    return parse_devices(devices) if devices is not None else load_cluster(cluster_file)


def _custom_devices(entry: Entry) -> dict[str, DeviceSpec]:
    custom: dict[str, DeviceSpec] = {}
    for name, spec in entry.items().items():
        key = normalise_device_name(name)
        if not _NAME.match(key):
            raise spec.fail(f"'{name}' cannot name a device: use letters, digits, '.', '-' and '_', "
                            "starting with a letter")
        if key in DEVICES or key in DEVICE_ALIASES:
            raise spec.fail(f"'{name}' is a catalogue device: pick a new name (with base: {name}) "
                            "or override its fields under calibration.devices")
        fields = spec.mapping((*_DEVICE_KEYS, "base"))
        if "base" in fields:
            base = lookup_device(fields["base"].string(), _where(fields["base"]), custom).to_json()
        else:
            base = {}
            for need, alternative in (("fp32_tflops", "peak_flops"), ("memory_gib", "memory_bytes"),
                                      ("bandwidth_gbs", "memory_bandwidth")):
                if need not in fields and alternative not in fields:
                    raise spec.fail(f"missing key '{need}' (or give base: a catalogue device)")
        overrides = _device_overrides(fields)
        peaks = {**base.pop("peak_flops", {}), **dict(overrides.pop("peak_flops", {}))}
        try:
            custom[key] = DeviceSpec(**{**base, **overrides, "name": key, "peak_flops": peaks})
        except ValueError as e:
            raise spec.fail(str(e)) from None
    return custom


def _device_overrides(fields: dict[str, Entry]) -> dict[str, object]:
    """Named DeviceSpec fields in SI units from a device mapping (unit keys converted)."""
    out: dict[str, object] = {}
    peaks: dict[str, float] = {}

    def put(table: dict, field: str, value: object, source: Entry) -> None:
        if field in table:
            raise source.fail(f"{field} given twice (once with units, once without?)")
        table[field] = value

    for key, value in fields.items():
        if key in _PEAK_KEYS:
            put(peaks, _PEAK_KEYS[key], value.number() * TFLOPS, value)
        elif key == "peak_flops":
            for dtype, v in value.items().items():
                put(peaks, dtype_key(dtype), v.number(), v)
        elif key in _DEVICE_UNITS:
            field, scale = _DEVICE_UNITS[key]
            put(out, field, _scaled(value.number(positive=field not in _MAY_BE_ZERO), scale), value)
        elif key in _DEVICE_SI:
            put(out, key, value.number(positive=key not in _MAY_BE_ZERO), value)
        elif key == "default_link":
            put(out, key, lookup_link(value.string(), _where(value)).name, value)
        elif key in _DEVICE_TABLES:
            field, scale, zero = _DEVICE_TABLES[key]
            put(out, field, tuple((op, _scaled(v.number(positive=not zero), scale)) for op, v in value.items().items()),
                value)
        elif key == "gpu":
            put(out, key, value.boolean(), value)
    if "memory_bytes" in out:
        out["memory_bytes"] = int(out["memory_bytes"])
    if peaks:
        out["peak_flops"] = tuple(peaks.items())
    return out


def _nodes(entry: Entry, extra: Mapping[str, DeviceSpec], shipped: bool) -> list[Node]:
    """A `nodes` entry's nodes. `nics` not given: the ports the devices' server ships with
    (`default_nics`) when `shipped`, else one (a file that names its `inter_link` describes its
    own network)."""
    fields = entry.mapping(("gpus", "intra_link", "nics", "count"), required=("gpus",))
    gpus = fields["gpus"]
    where = _where(gpus)
    if isinstance(gpus.value, str):
        devices = parse_node_devices(gpus.value, where, extra)
    elif isinstance(gpus.value, list) and gpus.value:
        devices = tuple(d for item in gpus.value for d in parse_node_devices(item.string(), _where(item), extra))
    else:
        raise gpus.fail("expected COUNTxTYPE (e.g. 8xv100-32g) or a list of device types")
    link = _link(fields["intra_link"], "intra") if "intra_link" in fields else default_intra_link(devices, where)
    nics = fields["nics"].integer(maximum=MAX_COUNT) if "nics" in fields else default_nics(devices) if shipped else 1
    count = fields["count"].integer(maximum=MAX_COUNT) if "count" in fields else 1
    return [Node(devices, link, nics)] * count


def _link(entry: Entry, role: str) -> LinkSpec:
    """A link: a catalogue name, or a mapping of bandwidth and latency (optionally from a base)."""
    if isinstance(entry.value, str):
        return lookup_link(entry.value, _where(entry))
    fields = entry.mapping((*_LINK_KEYS, "name", "base"))
    base = lookup_link(fields["base"].string(), _where(fields["base"])) if "base" in fields else None
    values = _link_overrides(fields)
    for field in ("bandwidth", "latency"):
        if field not in values and base is None:
            unit_key = "bandwidth_gbs" if field == "bandwidth" else "latency_us"
            raise entry.fail(f"missing key '{unit_key}' (or give base: a catalogue link)")
    name = fields["name"].string() if "name" in fields else (f"{base.name}-custom" if base else f"custom-{role}")
    start = base or LinkSpec(name, 1.0, 0.0)
    return dataclasses.replace(start, name=name, **values)


def _link_overrides(fields: dict[str, Entry]) -> dict[str, object]:
    values: dict[str, object] = {}
    kinds = []
    for key, value in fields.items():
        if key in _LINK_UNITS or key in ("bandwidth", "latency", "handoff", "call", "step_ratio"):
            field, scale = _LINK_UNITS.get(key, (key, 1.0))
            if field in values:
                raise value.fail(f"{field} given twice")
            values[field] = _scaled(value.number(positive=field in ("bandwidth", "step_ratio")), scale)
        elif key in KINDS:  # a collective kind's own latency and bandwidth
            own = _link_overrides(value.mapping(("latency_us", "latency", "bandwidth_gbs", "bandwidth_gbps",
                                                 "bandwidth")))
            if set(own) != {"latency", "bandwidth"}:
                raise value.fail(f"{key} needs a latency (latency_us) and a bandwidth (bandwidth_gbs)")
            kinds.append((key, own["latency"], own["bandwidth"]))
    if kinds:
        values["kinds"] = tuple(kinds)
    return values


def _calibration(entry: Entry, extra: Mapping[str, DeviceSpec], nested: bool = False) -> Calibration:
    fields = entry.mapping(("devices", "links") if nested else
                           ("devices", "links", "constants", "sharing", "cpus", "fitted_on"))
    devices, links, constants = [], [], []
    for name, spec in (fields["devices"].items() if "devices" in fields else {}).items():
        device = lookup_device(name, _where(spec), extra)
        if device.name in dict(devices):
            raise spec.fail(f"device {device.name} is calibrated twice")
        overrides = _device_overrides(spec.mapping(_DEVICE_KEYS))
        _check(spec, device, overrides)
        devices.append((device.name, tuple(overrides.items())))
    for name, spec in (fields["links"].items() if "links" in fields else {}).items():
        link = lookup_link(name, _where(spec))
        if link.name in dict(links):
            raise spec.fail(f"link {link.name} is calibrated twice")
        overrides = _link_overrides(spec.mapping(_LINK_KEYS))
        _check(spec, link, overrides)
        links.append((link.name, tuple(overrides.items())))
    for section, values in (fields["constants"].items() if "constants" in fields else {}).items():
        constants.append((section, tuple((k, v.number(positive=False)) for k, v in values.items().items())))
    sharing = []
    for count, body in (fields["sharing"].items() if "sharing" in fields else {}).items():
        if not str(count).isdigit() or int(count) < 2:
            raise body.fail(f"sharing: '{count}' should be a count of devices sharing a node (an int >= 2)")
        sharing.append((int(count), _calibration(body, extra, nested=True)))
    cpus = fields["cpus"].integer() if "cpus" in fields else 0
    fitted_on = []
    for item in fields["fitted_on"].list() if "fitted_on" in fields else []:
        model = item.mapping(("file", "sha256"), required=("file", "sha256"))
        fitted_on.append((model["file"].string(), model["sha256"].string()))
    return Calibration(tuple(devices), tuple(links), tuple(constants), entry.file, tuple(sorted(sharing)), cpus,
                       tuple(fitted_on))


def _check(entry: Entry, spec, overrides: dict[str, object]) -> None:
    """Fail at the entry's line if the overrides make an invalid spec."""
    if "peak_flops" in overrides:
        overrides = {**overrides, "peak_flops": {**dict(spec.peak_flops), **dict(overrides["peak_flops"])}}
    try:
        dataclasses.replace(spec, **overrides)
    except ValueError as e:
        raise entry.fail(str(e)) from None


def _scaled(value: float, scale: float) -> float:
    return value / round(1 / scale) if scale < 1 else value * scale


def _where(entry: Entry) -> str:
    return f"{entry.file}:{entry.line}: {entry.key}"
