"""Run under mpiexec: checks MpiComm's collectives against NumPy on every rank.

    mpiexec -n 4 python tests/exec/mpi_check.py collectives
    mpiexec -n 2 python tests/exec/mpi_check.py timeout [spin|nap]
    mpiexec -n 4 python tests/exec/mpi_check.py bells
"""

from __future__ import annotations

import sys
import time

import numpy as np

from parc.exec.comm import CommTimeout, MpiComm, usable_cpus


def data(rank: int) -> np.ndarray:
    return (np.arange(24, dtype=np.float32).reshape(4, 6) + 100 * rank)


def collectives() -> None:
    world = MpiComm(timeout=20)
    assert world.spin == (world.size <= len(usable_cpus())), (world.spin, world.size)  # one host, one affinity
    for spin in (world.spin, not world.spin):  # both ways of waiting, whatever this host's cores
        check(MpiComm(world.comm, timeout=20, spin=spin))
    print(f"rank {world.rank}: ok", flush=True)


def check(comm: MpiComm) -> None:
    r, n = comm.rank, comm.size
    every = [data(q) for q in range(n)]
    np.testing.assert_array_equal(comm.all_reduce(data(r)), sum(every))
    np.testing.assert_array_equal(comm.all_reduce(data(r), "max"), every[-1])
    np.testing.assert_array_equal(comm.all_gather(data(r), dim=1), np.concatenate(every, axis=1))
    np.testing.assert_array_equal(comm.reduce_scatter(data(r), dim=0), np.split(sum(every), n, axis=0)[r])
    got = comm.all_to_all(data(r), split_dim=0, concat_dim=1)
    np.testing.assert_array_equal(got, np.concatenate([np.split(every[q], n, axis=0)[r] for q in range(n)], axis=1))
    # pieces of any sizes (an all_to_all between strided or uneven splits): rank r sends q r+q+1
    # elements of value 10 r + q, bfloat16 too
    import ml_dtypes

    for dtype in (np.float32, ml_dtypes.bfloat16):
        pieces = [np.full(r + q + 1, 10 * r + q, dtype=dtype) for q in range(n)]
        got = comm.exchange(pieces, [p + r + 1 for p in range(n)])
        for p, part in enumerate(got):
            np.testing.assert_array_equal(part, np.full(p + r + 1, 10 * p + r, dtype=dtype))
            assert part.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(comm.broadcast(data(r), root=1), every[1])
    if r == 0:
        comm.send(data(0), peer=1, tag=7)
    elif r == 1:
        np.testing.assert_array_equal(comm.recv((4, 6), np.float32, peer=0, tag=7), every[0])
    # mesh axes of a 2x2 mesh: axis 0 groups ranks {0,2},{1,3}; axis 1 groups {0,1},{2,3}
    for axis, groups in ((0, [[0, 2], [1, 3]]), (1, [[0, 1], [2, 3]])):
        sub = comm.for_axis((2, 2), axis)
        group = next(g for g in groups if r in g)
        assert sub.size == 2 and sub.rank == group.index(r), (axis, sub.rank, group)
        np.testing.assert_array_equal(sub.all_reduce(data(r)), sum(every[q] for q in group))
        assert comm.for_axis((2, 2), axis) is sub  # cached
        assert sub.spin == comm.spin and comm.for_ranks(tuple(group)).spin == comm.spin
    comm.barrier()


def timeout(how: str) -> None:
    comm = MpiComm(timeout=2, spin=how == "spin")
    if comm.rank == 1:
        time.sleep(30)  # a rank that never joins (as if it died)
        return
    t = time.monotonic()
    try:
        comm.all_reduce(data(0))
    except CommTimeout as e:
        print(f"{e} after {time.monotonic() - t:.1f} s", flush=True)
        comm.abort(3)


def bells() -> None:
    """Ranks that share cores: ranks 0 and 1 compute about `busy` seconds while ranks 2 and 3
    wait on a recv from them, then on a collective the computing ranks join late; once napping
    50 us between polls (no doorbells), once on the doorbells (`MpiComm.bells`). On its doorbell
    a waiting rank uses under half the CPU; what it gets is what was sent."""
    world = MpiComm(timeout=60, spin=False)
    assert world.bells is not None, "ranks of one host that share its cores have doorbells"
    r = world.rank
    if r in (0, 2):
        assert world.for_ranks((0, 2)).bells is world.bells
    a = np.random.default_rng(r).standard_normal((192, 192)).astype(np.float32)
    busy = 0.4
    used = {}
    for comm in (MpiComm(world.comm, timeout=60, spin=False, bells=None), world):
        used[comm.bells is not None] = []
        for _ in range(3):
            comm.barrier()
            t, cpu = time.monotonic(), time.process_time()
            if r < 2:
                while time.monotonic() - t < busy:
                    a = np.tanh(a @ a.T / 192)
                comm.send(data(r), peer=r + 2, tag=3)
            else:
                np.testing.assert_array_equal(comm.recv((4, 6), np.float32, peer=r - 2, tag=3), data(r - 2))
                assert time.monotonic() - t > busy / 2
                used[comm.bells is not None].append(time.process_time() - cpu)
            if r < 2:
                time.sleep(busy / 4)  # late to the collective: the others wait for them
            np.testing.assert_array_equal(comm.all_reduce(data(r)), sum(data(q) for q in range(comm.size)))
    if r >= 2:
        naps, bells_ = min(used[False]), min(used[True])
        print(f"rank {r}: CPU in a {busy} s wait: {naps:.4f} s napping, {bells_:.4f} s on the doorbell", flush=True)
        assert bells_ < 0.5 * naps, (naps, bells_)
    print(f"rank {r}: ok", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "timeout":
        timeout(sys.argv[2])
    elif sys.argv[1] == "bells":
        bells()
    else:
        collectives()
