"""Shared helpers for sloth's benchmarks: what ran where, how long it took, how much memory it used.

Every benchmark writes one JSON file per run::

    {"benchmark": str, "env": {...}, "config": {...}, "columns": [str, ...], "rows": [{column: value}]}

so that `render_markdown` can turn any of them into a table (``python -m benchmarks.common FILE...``).

Timing is a median: on CUDA through `triton.testing.do_bench` (CUDA events, L2 flushed before each
rep, warm-up included); on CPU a wall-clock median, good only for proving a code path runs.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
GiB = 1024**3
MiB = 1024**2


# ----------------------------------------------------------------------------- setup


def use_triton_interpreter_without_cuda() -> bool:
    """Set TRITON_INTERPRET=1 when there is no CUDA device, so Triton kernels run on CPU tensors.

    Triton reads the variable when a kernel is decorated, i.e. when `sloth` (or peft, which
    imports triton) is first imported: call this before those imports. Returns True if set.
    """
    if torch.cuda.is_available():
        return False
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return True


def import_sloth() -> Any:
    """Import sloth and make sure `backend="sloth"` resolves.

    sloth is found through its installed entry point; on a machine where the checkout was copied
    but never installed (the device machine), the repository root *is* the package
    (setup.cfg: ``package_dir sloth = .``), so we load it from there under the name ``sloth``.
    """
    try:
        sloth = importlib.import_module("sloth")
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "sloth", REPO_ROOT / "__init__.py", submodule_search_locations=[str(REPO_ROOT)]
        )
        if spec is None or spec.loader is None:
            raise
        sloth = importlib.util.module_from_spec(spec)
        sys.modules["sloth"] = sloth
        spec.loader.exec_module(sloth)
    # Without an installed entry point Dynamo cannot find the backend by name: register it by hand.
    from torch._dynamo.backends.registry import list_backends, register_backend

    if "sloth" not in list_backends(exclude_tags=()):
        backend = importlib.import_module("sloth.compiler.backend").sloth_backend
        register_backend(compiler_fn=backend, name="sloth")
    return sloth


# ----------------------------------------------------------------------------- environment


def _run(cmd: Sequence[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Where and with what a result was measured (device, driver, library versions, date, commit)."""
    cuda = torch.cuda.is_available()
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    # The device machine's copy of the tree may carry no .git, or (seen 2026-11-29) a stale one from the
    # start of the session, so a GIT_COMMIT set by whoever launched the run wins.
    commit = os.environ.get("GIT_COMMIT") or _run(["git", "rev-parse", "HEAD"])
    dirty = None if os.environ.get("GIT_COMMIT") else _run(["git", "status", "--porcelain"])
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "driver": driver.splitlines()[0] if driver else None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "git_commit": commit,
        "git_dirty": bool(dirty) if dirty is not None else None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        # sloth's environment switches (the integrations' kill switches; older records: measurement switches)
        "sloth_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SLOTH_")},
        # the caching allocator's settings (expandable segments change how often it calls cudaMalloc/cudaFree)
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
    }


# ----------------------------------------------------------------------------- host-only models


def tiny_lora_llama(layers: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """(model, input ids): a Llama of ``layers`` tiny layers (hidden 32) with peft LoRA r 4 on every linear, on
    the CPU, seed 0. At 32 layers it has the 8B model's parameter tensors (739) and op count with nothing to
    compute: for measuring host costs that scale with those (guard_cost.py, gc_cost.py)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                            num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                            max_position_embeddings=64)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(transformers.AutoModelForCausalLM.from_config(cfg), LoraConfig(r=4, target_modules=targets))
    return model, torch.randint(0, 64, (1, 8))


# ----------------------------------------------------------------------------- GPU telemetry

_TELEMETRY_FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class GpuTelemetry:
    """``nvidia-smi`` sampling the GPU's SM clock (MHz), board power (W), temperature and active throttle
    reasons every ``period_ms`` while the ``with`` block runs: whether a timed loop ran at a capped clock (a
    step bound by power moves with the clock, one bound by the host does not). ``summary()`` is None where
    there is no nvidia-smi (the CPU)."""

    def __init__(self, period_ms: int = 100) -> None:
        self.period_ms = period_ms
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.out: Any = None

    def __enter__(self) -> "GpuTelemetry":
        import tempfile

        self.out = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a long loop never fills it and stalls
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={_TELEMETRY_FIELDS}", "--format=csv,noheader,nounits",
                 f"-lms={self.period_ms}"], stdout=self.out, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.out.seek(0)
            self.lines = [ln for ln in self.out.read().splitlines() if ln.strip()]
        self.out.close()

    def summary(self) -> dict[str, Any] | None:
        """Median and min SM clock, median and max power, max temperature, and how often each throttle-reason
        bit mask was active (nvidia-smi's hex mask: 0x4 software power cap, 0x20/0x40 thermal slowdown)."""
        clocks, power, temp, reasons = [], [], [], {}
        for ln in self.lines:
            parts = [p.strip() for p in ln.split(",")]
            if len(parts) != 4:
                continue
            try:
                clocks.append(float(parts[0]))
                power.append(float(parts[1]))
                temp.append(float(parts[2]))
            except ValueError:
                continue
            reasons[parts[3]] = reasons.get(parts[3], 0) + 1
        if not clocks:
            return None
        return {"samples": len(clocks), "sm MHz median": statistics.median(clocks), "sm MHz min": min(clocks),
                "power W median": statistics.median(power), "power W max": max(power), "temp C max": max(temp),
                "throttle reasons": reasons}


class GcPauses:
    """Python's garbage collections while the ``with`` block runs, by generation: how many and how long
    (``gc.callbacks``). A generation-2 collection walks every tracked object (about a million in a process
    that compiled a 32-layer model: half a second), so one inside a timed loop shows as a slow step."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._start) * 1e3))

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, dict[str, float]]:
        """{"gen N": {"collections": n, "ms": total, "max ms": longest}} for each generation that ran."""
        out: dict[str, dict[str, float]] = {}
        for generation, ms in self.pauses:
            entry = out.setdefault(f"gen {generation}", {"collections": 0, "ms": 0.0, "max ms": 0.0})
            entry["collections"] += 1
            entry["ms"] = round(entry["ms"] + ms, 3)
            entry["max ms"] = round(max(entry["max ms"], ms), 3)
        return out


# Counters of torch.cuda.memory_stats() that say the caching allocator went to the driver: a cudaMalloc or cudaFree
# (each may synchronise the device), a retry after freeing its cache (a synchronisation of every stream).
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams", "num_ooms")


def allocator_counters() -> dict[str, int]:
    """ALLOCATOR_COUNTERS now (empty without CUDA); the difference of two readings is what a loop cost."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


# ----------------------------------------------------------------------------- timing and memory


def bench_ms(
    fn: Callable[[], Any],
    *,
    warmup_ms: int = 25,
    rep_ms: int = 100,
    grad_to_none: Sequence[torch.Tensor] | None = None,
    cpu_reps: int = 3,
) -> float:
    """Median milliseconds of one call of `fn`.

    CUDA: `triton.testing.do_bench(return_mode="median")`, which warms up for `warmup_ms`, runs for
    about `rep_ms`, clears the L2 before every rep (so memory-bound ops are not flattered by a hot
    cache) and sets `grad_to_none` to None between reps (so backward does not time accumulation).
    CPU: a wall-clock median of `cpu_reps` calls after one warm-up call; not a measurement.
    """
    if torch.cuda.is_available():
        import triton.testing

        return float(
            triton.testing.do_bench(
                fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none or []), return_mode="median"
            )
        )
    fn()
    times = []
    for _ in range(cpu_reps):
        for t in grad_to_none or []:
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def kernel_ms(fn: Callable[[], Any], *, iters: int = 20, grad_to_none: Sequence[torch.Tensor] | None = None
              ) -> float | None:
    """GPU kernel time of one call of `fn`, in ms: the sum of its kernels' device time, no launch gaps.

    `bench_ms` times calls end to end, which at small sizes measures Python and launch overhead
    (seen: every provider at 0.1-0.2 ms for a 4096 x 4096 RMSNorm whose bytes take 0.02 ms). In a
    training step the GPU runs ahead of the host and those gaps mostly vanish, so the kernel time is
    the number to hold against the bandwidth floor. The L2 is flushed before each call with a
    `zero_()` whose fill kernel is left out of the sum. None on CPU.
    """
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * MiB, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            for t in grad_to_none or []:
                t.grad = None
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages()
                   if e.self_device_time_total > 0 and "FillFunctor" not in e.key)
    return total_us / iters / 1e3


def peak_memory_bytes(fn: Callable[[], Any]) -> int | None:
    """Peak CUDA memory that one call of `fn` allocates above what was allocated before it.

    What already exists (inputs, a retained autograd graph) is not counted; what `fn` returns is,
    if it is still alive at its peak. None on CPU, where the caching allocator keeps no statistics.
    """
    if not torch.cuda.is_available():
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def copy_bandwidth_gbps(nbytes: int = 2 * GiB) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes), counting bytes read plus written.

    The ceiling that memory-bound kernels are held to: a plain `dst.copy_(src)` of `nbytes`,
    far past the 60 MB L2, timed like every kernel (median, L2 flushed).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = nbytes if device == "cuda" else 16 * MiB  # CPU: proves the code path only
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Measured dense matmul rate, TFLOP/s, of an n x n x n product on random data (2 n^3 FLOPs).

    The MFU denominator: the H200's datasheet says ~990 bf16 TFLOP/s, a random-data 8192^3 product
    measures ~790, and only the measured number is reachable.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = n if device == "cuda" else min(n, 256)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = bench_ms(lambda: a @ b, rep_ms=200)
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------- results


def result_record(
    benchmark: str, config: dict[str, Any], columns: list[str], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The JSON document every benchmark writes."""
    return {"benchmark": benchmark, "env": environment(), "config": config, "columns": columns, "rows": rows}


def write_result(record: dict[str, Any], results_dir: Path | None = None, suffix: str = "") -> list[Path]:
    """Write `record` as `<UTC date>_<benchmark><suffix>.json` into the results folder and, when the
    OUT environment variable is set (the device machine), into $OUT as well; also a `.md` table
    beside each. Returns the paths written."""
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    stem = f"{date}_{record['benchmark']}{suffix}"
    dirs = [results_dir or RESULTS_DIR]
    if os.environ.get("OUT"):
        dirs.append(Path(os.environ["OUT"]))
    written = []
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{stem}.json"
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
        path.with_suffix(".md").write_text(render_markdown([record]))
        written.append(path)
    return written


def _cell(value: Any, column: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and column == "loss":
        return f"{value:.4f}"  # losses of variants are compared to the 4th decimal
    if isinstance(value, float):
        # ms, GB/s, tokens/s: integers carry no meaning past 4 digits; losses need 4 significant.
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)


def render_markdown(records: Iterable[dict[str, Any]]) -> str:
    """Markdown: for each record a heading (benchmark, device, date, commit) and its rows as a table."""
    parts = []
    for rec in records:
        env = rec.get("env", {})
        commit = (env.get("git_commit") or "no commit")[:10] + (" (dirty)" if env.get("git_dirty") else "")
        parts.append(
            f"### {rec['benchmark']} on {env.get('device')} ({env.get('date')}, torch {env.get('torch')}, "
            f"triton {env.get('triton')}, {commit})\n"
        )
        cols = rec["columns"]
        parts.append("| " + " | ".join(cols) + " |")
        parts.append("|" + "---|" * len(cols))
        for row in rec["rows"]:
            parts.append("| " + " | ".join(_cell(row.get(c), c) for c in cols) + " |")
        parts.append("")
    return "\n".join(parts) + "\n"


def render_text(columns: list[str], rows: list[dict[str, Any]]) -> str:
    """A fixed-width table for the terminal."""
    cells = [[_cell(r.get(c), c) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.common RESULT.json...``: print the results as markdown tables."""
    paths = argv if argv is not None else sys.argv[1:]
    if not paths:
        sys.exit("usage: python -m benchmarks.common RESULT.json [RESULT.json ...]")
    print(render_markdown(json.loads(Path(p).read_text()) for p in paths), end="")


if __name__ == "__main__":
    main()
