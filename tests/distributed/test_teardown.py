"""A run's process group is gone, with gloo's worker threads, before the interpreter shuts down.

torch keeps a destroyed group alive in two places: ``torch.distributed.nn.functional``'s default
arguments (bound when torch._dynamo first imports it) and the meshes its DTensor caches hold. A group
alive at shutdown lets a gloo worker free a last collective's tensors while the interpreter finalizes,
which aborts the process ("terminate called without an active exception"; one two-rank generation in
ten under load). Each check runs in a fresh interpreter: the import order is the point.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    from trainer.environment import destroy_distributed, init_distributed

    def gloo_threads():
        names = []
        for t in os.listdir("/proc/self/task"):
            try:
                names.append(open(f"/proc/self/task/{t}/comm").read().strip())
            except OSError:  # a thread that ended meanwhile
                pass
        return sum(n.startswith(("pt_gloo", "gloo")) for n in names)

    assert init_distributed(1, 0, torch.device("cpu"), single_process_group=True)
    import torch._dynamo  # noqa: F401  (imports torch.distributed.nn.functional after the group exists)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import torch.distributed._functional_collectives as funcol

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    whole = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)]).full_tensor()
    summed = funcol.all_reduce(torch.randn(7), "sum", mesh) + 1
    before = gloo_threads()
    destroy_distributed(mesh if sys.argv[1] == "mesh" else None)
    print(before, gloo_threads())
""")


def _threads(mesh_given: bool) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, "mesh" if mesh_given else "none"], capture_output=True,
                         text=True, timeout=120, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split()[-2:])
    return before, after


def test_destroy_distributed_stops_gloos_threads():
    before, after = _threads(mesh_given=True)
    assert before >= 2, "expected gloo's worker threads while the group lives"
    assert after == 0, f"{after} gloo threads outlived destroy_distributed"


def test_a_cached_mesh_not_given_keeps_the_group_alive():
    """The control: without the mesh, torch's caches keep the destroyed group (and its threads)."""
    before, after = _threads(mesh_given=False)
    assert before >= 2 and after == before
