"""`parc profile`: measure what the cost model needs on this machine, write a calibration file.

For each count k of ranks sharing this host (1, 2, 4, ... up to `--ranks`), one MPI job of k
ranks runs the same microbenchmarks on every rank at once, with the engine and the threads per
rank `parc run` gives a plan of k ranks (`runner.rank_threads`), so each figure is what a rank
gets while its neighbours work too. Each benchmark is one op in a session of the engine `parc run
--engine` would use (onnxruntime by default; `--engine cupy` measures one GPU through parc's
array engine, with sizes a GPU's training step has, `GPU_SIZES`), run for `--seconds` (on a CPU
with one set of inputs, warm as a step's just-written tensors; on a GPU rotating through more
memory than its L2: `POOL_BYTES`); the mean is kept:

- the launch floor (the slope of a chain of tiny Adds over its length) and the task overhead
  (what one `session.run` costs beyond its node);
- memory bandwidth: the memory-bound ops as training graphs have them (`MEMORY_OPS`), 1-16 MiB,
  and on a CPU an Add at more sizes, to tell the caches' rate from memory's (`fit_cache`): the
  rates written are memory's, which a step's tensors stream at;
- on a CPU, short pieces and small nodes: the ops that walk short pieces (`PIECE_OPS`: a
  Transpose's runs, a row, a broadcast's span; `parc.ops.node_pieces`) again on narrow tensors,
  each class's rate and cost per piece fitted together (`fit_pieces`); then every memory-bound op
  on 16 KiB and two small products, as `COPIES` copies of the node in one session: what such a
  node takes beyond its launch floor, rate and pieces is its class's floor;
- float32 FLOP/s: matmuls of training shapes (`MATMULS`) and convolutions by class (`CONVS`);
  the fastest class's rate is the peak, the others fractions of it (`compute_efficiency`,
  `op_efficiency`). Each class's figure is the geometric mean of its sizes' rates, the value that
  minimises the squared log error of the roofline over them. With `--model FILE`, the model's own
  products and convolutions (`model_cases`, the shapes holding 95% of each class's FLOPs) replace
  the built-in cases of the classes it has, at each rank count's share of the batch, and such a
  class's figure is the model's FLOPs over its time;
- collectives (k >= 2): all-reduces of 64 B to 4 MiB through parc's communicator, over the whole
  job and (even k > 2) over pairs while the other pairs compute, `ARRIVALS` rounds of a first
  one after compute then a burst: the burst fits `call + 2(n-1) alpha + 2(n-1)/n B / beta`
  (`fit_collectives`: least squares on the relative error; the call cost needs two group
  sizes), the first's excess at the smallest size (64 B, where no bandwidth term is mixed in) is
  the link's handoff; then reduce-scatters, all-gathers and all-to-alls in bursts, each kind's
  own alpha and beta (`fit_kind`);
- on CPUs, for each count of ranks with a core each, a traced tensor-parallel reference step
  (`link_ratios`): the link's `step_ratio` and its handoff in a step's terms (`fit_link_ratio`).

On CPUs the profile ends with reference training steps (`reference_steps`: the `--model` files,
else a convolutional net and an encoder-decoder from the zoo, planned on k ranks with the figures
just written and run with `parc run`); per k, what their simulated compute must be multiplied by to take their
measured time is the device's `step_ratio` (`fit_step_ratio`), which multiplies every node's time.
The benchmarks price each node warm and alone; a step's nodes run on tensors other nodes wrote,
and its ranks wait at each collective for the last of them.

A fixed product (`host_probe`) is timed before each rank count and at the end: the file's header
lists the host's speed at each against the first, and a spread above 15% is warned about. It is
timed again before each reference step, whose measured time is taken at the speed its count's
figures saw (`reference_steps`' `host_speed`).

The file (docs/cluster.md, "Calibration") holds one rank's device figures and the smallest
multi-rank count's link figures at the top, and k ranks' figures under `sharing."k"`, which
`parc plan --calibration` applies to nodes of k devices. The raw timings are written as comments.

The modules, in the order a profile runs them: `catalogue` (the built-in benchmarks and their
sizes), `cases` (a `--model`'s own products and convolutions), `graphs` (the ONNX model of each
benchmark), `session` (one benchmark in an engine's session, timed), `measure` (what each rank
measures; `worker`), `host` (the host's speed and its GPU), `fit` (the figures fitted on the
rows), `file` (the calibration file), `reference` (the reference steps and their ratios) and
`driver` (`profile`, all of it in turn). The package sits above `parc.exec` (it runs parc's
engines and communicators) and below the planner, which it runs only as `parc plan` in a
subprocess.
"""

from parc.calibrate.catalogue import BUDGET
from parc.calibrate.driver import profile
from parc.calibrate.host import gpu_device_type, host_probe
from parc.calibrate.measure import worker

__all__ = ["BUDGET", "gpu_device_type", "host_probe", "profile", "worker"]
