"""Test setup: Triton kernels run through the CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before sloth is imported (Triton reads it as each kernel is defined, and sloth defines
its kernels, and reads it once, at import), so it is set here, at collection. tests/test_reference_path.py runs
the model tests once more on the ops' PyTorch references, the path of a CPU without the variable.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _register_backend_name() -> None:
    """``backend="sloth"`` is found through the package's ``torch_dynamo_backends`` entry point, which exists only
    where sloth is pip-installed. The device machine imports the checkout through a symlink instead
    (benchmarks/gpu_lane.py), so the name is registered here when the entry point is missing."""
    import torch._dynamo

    import sloth

    if "sloth" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(sloth.sloth_backend, "sloth")


_register_backend_name()


def pytest_configure(config):
    """benchmarks/gpu_lane.py runs a few xdist workers on one GPU and caps each at an equal share of its memory
    (SLOTH_TEST_GPU_MEMORY_FRACTION): a test that needs more fails the same way whatever runs beside it."""
    fraction = os.environ.get("SLOTH_TEST_GPU_MEMORY_FRACTION")
    if fraction and hasattr(config, "workerinput") and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(fraction))


def pytest_addoption(parser):
    parser.addoption("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                     help="the device of the op tests' tensors (the `device` fixture): cuda where there is one, else "
                          "cpu (Triton kernels in the interpreter); cpu on a GPU machine runs the references only")
    parser.addoption("--slow", action="store_true",
                     help="also run the slow tests listed in tests/slow.txt (whole-trainer and two-process runs, "
                          "the long tail of model compiles), which the README's test command leaves out")


def pytest_collection_modifyitems(config, items):
    """Leave out the tests tests/slow.txt lists unless ``--slow`` is given (tests/slow.py says why and how the list
    is made); pytest counts them as deselected and the summary says how to run them."""
    if config.getoption("--slow"):
        return
    from slow import read

    listed = read()
    slow = [item for item in items if item.nodeid in listed]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.nodeid not in listed]
        config._sloth_slow_left_out = len(slow)


def pytest_terminal_summary(terminalreporter, config):
    if config.getoption("--slow"):
        return
    # Under xdist the workers collect, so the controller knows only the list, not how many of it this run selected.
    from slow import read

    left_out = getattr(config, "_sloth_slow_left_out", None)
    count = f"{left_out} slow tests" if left_out is not None else f"the slow tests (up to {len(read())})"
    terminalreporter.write_line(f"sloth: {count} of tests/slow.txt left out; python -m pytest tests --slow runs them")


@pytest.fixture
def device(request) -> str:
    return request.config.getoption("--device")


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    """Each test compiles from scratch: no cache entries or automatic-dynamic state leak across tests.

    Afterwards, every site a family looks for in whatever the test compiled was replaced or given a reason
    (compiler/anchors.py): a silent miss in any model of the suite fails its test, unless the test is marked
    ``unexplained_sites`` (it makes one on purpose); and no pass raised (compiler/pass_guard.py undoes one that
    does, so the test's numbers alone would not show it), unless the test is marked ``pass_failure``."""
    import torch._dynamo

    import sloth

    torch._dynamo.reset()
    sloth.reset_report()
    yield
    torch._dynamo.reset()
    if request.node.get_closest_marker("unexplained_sites") is None:
        unexplained = sloth.report().unexplained
        assert not unexplained, f"sites neither replaced nor explained: {unexplained}"
    if request.node.get_closest_marker("pass_failure") is None:
        failed = sloth.report().failed
        assert not failed, f"a pass raised and was undone (compiler/pass_guard.py): {failed}"


@pytest.fixture
def one_rank_group():
    """A one-process gloo group in the test's own process, for tests of distributed wrappers at world size 1
    (tests/test_dtensor.py, tests/test_ddp_split.py; tests/test_distributed.py starts processes of its own)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
