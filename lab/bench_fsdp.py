"""FSDP figures for benchmark.py's `fsdp` part: one model, 2 processes (torchrun, gloo, CPU), the
local S3 on loopback.

    python lab/bench_fsdp.py [--quick]      # the figures, as benchmark.py's JSON entries

memory: the same model trained a few steps under DDP and under FSDP; each rank's peak RSS and the
bytes of weights, gradients and AdamW state it holds.
saves (FSDP): a synchronous sharded save; background saves through the toolkit's save processes
(async_save.AsyncSaver + sharded.py) and through DCP's own async_save (process executor, shared-
memory staging), each: how long training waits per save, and the step time while the save runs
over the step time with none; the time to a checkpoint in S3 (local commit, then the uploader's
put_checkpoint, manifest last) beside s3torchconnector's DCP writer straight to S3; restore time
(job/restore.py's fetch, verified, then DCP's load) beside s3torchconnector's DCP reader.
restore bytes per node: the saved step fetched as node 0 and node 1 of a group of 2 (restore
--ranks) and whole.

The worker (one per rank, under torchrun) is this file: `bench_fsdp.py worker MODE OUT ENDPOINT`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for folder in ("code", "job", "lab"):
    if str(ROOT / folder) not in sys.path:
        sys.path.insert(0, str(ROOT / folder))

BUCKET = "test-bucket"
QUICK_MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 256, "block_size": 64, "vocab_size": 4096}
FULL_MODEL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 256, "vocab_size": 50304}  # GPT-2 124M
SAVES = 3  # background saves measured per method
STEPS_AFTER_SAVE = 3  # steps timed while a background save runs


# -- the worker (every rank) ------------------------------------------------------------------

def worker(mode: str, out: Path, endpoint: str, quick: bool) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model, optimizer, step = build(mode, quick)
    step()  # AdamW's state exists from the first step
    result = {"rank": rank, "peak_rss_mb_with_init": peak_rss_mb()}
    if mode in ("ddp", "fsdp"):
        reset_peak_rss()  # from here: training (the model is drawn whole on the CPU either way, once)
        for _ in range(3):
            step()
        result.update(memory(model, optimizer))
    else:
        result.update(saves(model, optimizer, step, out, endpoint, rank))
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def build(mode: str, quick: bool):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import config
    import sharded
    from model import GPT

    cfg = config.ModelConfig(**(QUICK_MODEL if quick else FULL_MODEL))
    if mode == "ddp":
        model = GPT(cfg)
        wrapped = DDP(model)
    else:
        model = wrapped = sharded.build(lambda: GPT(cfg), lambda m: m.transformer.h, torch.device("cpu"), False, False)
    optimizer = model.make_optimizer(0.1, 6e-4, (0.9, 0.95), "cpu")
    x = torch.randint(cfg.vocab_size, (2, cfg.block_size))

    def step() -> float:
        started = time.monotonic()
        _, loss = wrapped(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated: part of what a rank holds
        return time.monotonic() - started

    return model, optimizer, step


def memory(model, optimizer) -> dict:
    import torch

    def local(tensor) -> int:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return tensor.numel() * tensor.element_size()

    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(local(p) for p in params)
    grads = sum(local(p.grad) for p in params if p.grad is not None)
    adam = sum(local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    cuda = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None  # unmeasured here
    return {"weights": weights, "grads": grads, "optimizer": adam, "state_bytes": weights + grads + adam,
            "peak_rss_mb": peak_rss_mb(), "cuda_peak_mb": cuda}


def reset_peak_rss() -> None:
    """Linux: the peak RSS (VmHWM) starts again from the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def saves(model, optimizer, step, out: Path, endpoint: str, rank: int) -> dict:
    import torch.distributed as dist

    import checkpoint
    import sharded
    from async_save import AsyncSaver, snapshot_bytes

    root = out / "checkpoints"
    baseline = [step() for _ in range(4)]
    sync_started = time.monotonic()
    sync = sharded.ShardedCheckpoints(rank, dist.get_world_size(), None, lambda _: None)
    final = root / checkpoint.step_dir_name(1)
    sync.save(final, model, optimizer, {"step": 1, "rng": []}, {"step": 1, "keep": 100}, False, 100)
    dist.barrier()
    result = {"baseline_step_s": statistics.median(baseline), "sync_save_s": time.monotonic() - sync_started}
    result.update(to_s3_and_back(sync, final, model, optimizer, endpoint, rank))

    saver = AsyncSaver(__import__("torch").device("cpu"), lambda _: None)
    ours = sharded.ShardedCheckpoints(rank, dist.get_world_size(), None, lambda _: None, saver)
    saver.start()
    saver.reserve(snapshot_bytes(ours.snapshot_tree(model, optimizer)) + (16 << 20))
    blocked, during = [], []
    for n in range(SAVES):
        started = time.monotonic()
        ours.save(root / checkpoint.step_dir_name(10 + n), model, optimizer, {"step": 10 + n, "rng": []},
                  {"step": 10 + n, "keep": 100}, False, 100)
        blocked.append(time.monotonic() - started)
        during += [step() for _ in range(STEPS_AFTER_SAVE)]
        saver.wait()
        dist.barrier()
    saver.close()
    result.update(toolkit_blocked_s=blocked, toolkit_steps_s=during)
    result.update(dcp_async(model, optimizer, step, out, rank))
    return result


def dcp_async(model, optimizer, step, out: Path, rank: int) -> dict:
    """DCP's own background save: async_save with its process executor and shared-memory staging
    (pinned too, where CUDA is), into a plain folder (no manifest: its stall is what is measured)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    import sharded

    cuda = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=cuda,
                                          use_non_blocking_copy=cuda))
    blocked, during = [], []
    for n in range(SAVES + 1):  # the first spawns DCP's process: not counted
        _, shards, _ = sharded.state_parts(model, optimizer)
        started = time.monotonic()
        response = dcp.async_save(shards, storage_writer=dcp.FileSystemWriter(out / f"dcp-{n}"),
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
        staged = getattr(response, "staging_completion", None)
        if staged is not None:
            staged.result()
        took = time.monotonic() - started
        steps = [step() for _ in range(STEPS_AFTER_SAVE)]
        getattr(response, "upload_completion", response).result()
        dist.barrier()
        if n:
            blocked.append(took)
            during += steps
        else:
            first = took
    stager.close()
    return {"dcp_blocked_s": blocked, "dcp_steps_s": during, "dcp_first_blocked_s": first}


def to_s3_and_back(shards, final: Path, model, optimizer, endpoint: str, rank: int) -> dict:
    """The sync checkpoint to S3 and back two ways: the toolkit's (upload the committed folder,
    manifest last; restore.py's fetch, verified; DCP's load from disk) and s3torchconnector's DCP
    writer and reader, straight to and from S3."""
    import boto3
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem, S3StorageReader, S3StorageWriter

    import remote_checkpoints
    import s3 as s3lib

    s3 = boto3.client("s3", endpoint_url=endpoint)
    ckpts = s3lib.Location(BUCKET, "bench/fsdp/checkpoints/")
    result = {}
    dist.barrier()
    if rank == 0:
        started = time.monotonic()
        files = checkpoint_files(final)
        handles = {name: open(final / name, "rb") for name in files}
        try:
            manifest_bytes = (final / "manifest.json").read_bytes()
            remote_checkpoints.put_checkpoint(s3, ckpts, final.name, handles, manifest_bytes,
                                              json.loads(manifest_bytes)["files"], lambda call, *a, **k: call(*a, **k),
                                              lambda _: None)
        finally:
            for handle in handles.values():
                handle.close()
        result["upload_s"] = time.monotonic() - started
        started = time.monotonic()
        manifest, problem = remote_checkpoints.manifest_of(s3, ckpts, final.name, lambda call, *a, **k: call(*a, **k))
        assert problem is None, problem
        problem = remote_checkpoints.fetch(s3, ckpts, final.name, manifest, final.parent.parent / "restored",
                                           lambda call, *a, **k: call(*a, **k))
        assert problem is None, problem
        result["fetch_s"] = time.monotonic() - started
    dist.barrier()
    started = time.monotonic()
    shards.load(final.parent.parent / "restored" / final.name, model, optimizer)
    dist.barrier()
    result["load_s"] = time.monotonic() - started

    client = S3Client("us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True))
    uri = f"s3://{BUCKET}/bench/fsdp-s3tc/step-1/"
    import sharded

    _, parts, _ = sharded.state_parts(model, optimizer)
    writer = S3StorageWriter("us-east-1", uri)
    writer.fs = S3FileSystem("us-east-1", s3_client=client)
    dist.barrier()
    started = time.monotonic()
    dcp.save(parts, storage_writer=writer)
    dist.barrier()
    result["s3tc_save_s"] = time.monotonic() - started
    reader = S3StorageReader("us-east-1", uri)
    reader.fs = S3FileSystem("us-east-1", s3_client=client)
    started = time.monotonic()
    dcp.load(parts, storage_reader=reader)
    dist.barrier()
    result["s3tc_load_s"] = time.monotonic() - started
    return result


def checkpoint_files(final: Path) -> list[str]:
    import checkpoint

    return sorted(checkpoint.read_manifest(final)["files"])


# -- the driver --------------------------------------------------------------------------------

def run_worker(mode: str, out: Path, endpoint: str, quick: bool) -> list[dict]:
    # A fixed mmap threshold: every tensor's memory is its own mapping, given back when freed, so the
    # RSS follows the bytes alive (glibc's own threshold rises after the first large free, and freed
    # tensors then stay in its heap, counted as resident).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "AWS_ENDPOINT_URL": endpoint,
           "MALLOC_MMAP_THRESHOLD_": str(128 << 10),
           "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
           "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
           "AWS_DEFAULT_REGION": "us-east-1"}
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2", __file__,
               "worker", mode, str(out), endpoint] + (["--quick"] if quick else [])
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} worker exit {result.returncode}: {(result.stdout + result.stderr)[-2000:]}")
    return [json.loads((out / f"{mode}-rank{rank}.json").read_text()) for rank in (0, 1)]


def measure(s3, endpoint: str, folder: Path, quick: bool) -> dict[str, dict]:
    from bench_report import figure

    folder.mkdir(parents=True, exist_ok=True)
    shape = QUICK_MODEL if quick else FULL_MODEL
    model = f"GPT {shape['n_layer']} layers of {shape['n_embd']}, vocab {shape['vocab_size']}"
    ddp, fsdp = (run_worker(mode, folder, endpoint, quick) for mode in ("ddp", "fsdp"))
    saves = run_worker("saves", folder, endpoint, quick)
    nodes = per_node_restore(s3, folder)
    first = saves[0]
    toolkit, dcp = statistics.median(first["toolkit_blocked_s"]), statistics.median(first["dcp_blocked_s"])
    base = first["baseline_step_s"]
    how = f"{model}, 2 processes (gloo, CPU, one thread each)"
    state = lambda runs: max(r["state_bytes"] for r in runs)  # noqa: E731
    rss = lambda runs: max(r["peak_rss_mb"] for r in runs)  # noqa: E731
    return {
        "fsdp_state_bytes_per_rank": figure(
            "fsdp_state_bytes_per_rank", state(fsdp), f"{how}: weights + gradients + AdamW state one rank holds, "
            f"FSDP over DDP", state(ddp), ddp=ddp, fsdp=fsdp),
        "fsdp_peak_rss_per_rank_mb": figure(
            "fsdp_peak_rss_per_rank_mb", rss(fsdp), f"{how}: the largest rank's peak RSS over 3 training steps (torch "
            f"itself included; the peak reset after the model was built and one step taken; glibc's mmap threshold "
            f"fixed at 128 KB), FSDP over DDP", rss(ddp),
            with_init=[max(r["peak_rss_mb_with_init"] for r in runs) for runs in (ddp, fsdp)]),
        "fsdp_stall_toolkit_s": figure(
            "fsdp_stall_toolkit_s", toolkit, f"{how}: seconds training waits per background save with the toolkit's "
            f"save processes (median of {SAVES}); floor: a synchronous save", first["sync_save_s"],
            blocked=first["toolkit_blocked_s"], step_s_during=statistics.median(first["toolkit_steps_s"]),
            step_s_alone=base),
        "fsdp_stall_dcp_async_s": figure(
            "fsdp_stall_dcp_async_s", dcp, f"{how}: seconds training waits per save with DCP's async_save (process "
            f"executor, shared-memory staging; median of {SAVES}, its first, which starts the process, apart); "
            f"floor: the toolkit's", toolkit, blocked=first["dcp_blocked_s"], first=first["dcp_first_blocked_s"],
            step_s_during=statistics.median(first["dcp_steps_s"]), step_s_alone=base),
        "fsdp_to_s3_s": figure(
            "fsdp_to_s3_s", first["sync_save_s"] + first["upload_s"], f"{how}: a synchronous sharded save committed "
            f"on disk, then put in S3 by the uploader's put_checkpoint (manifest last); floor: s3torchconnector's DCP "
            f"writer straight to S3 (no manifest, no sha256)", first["s3tc_save_s"], save_s=first["sync_save_s"],
            upload_s=first["upload_s"]),
        "fsdp_restore_s": figure(
            "fsdp_restore_s", first["fetch_s"] + first["load_s"], f"{how}: restore.py's fetch (every file verified) "
            f"then DCP's load from disk; floor: s3torchconnector's DCP reader straight from S3 (nothing verified)",
            first["s3tc_load_s"], fetch_s=first["fetch_s"], load_s=first["load_s"]),
        "fsdp_restore_bytes_per_node": figure(
            "fsdp_restore_bytes_per_node", max(nodes["node_bytes"]), f"{how}: bytes a node of a group of 2 nodes x 1 "
            f"process fetches with restore --ranks (the larger node); floor: the whole checkpoint, which each node "
            f"fetched before", nodes["whole_bytes"], **nodes),
    }


def per_node_restore(s3, folder: Path) -> dict:
    """The step the saves part put in S3, fetched as node 0 and node 1 of 2, and whole."""
    import remote_checkpoints
    import s3 as s3lib

    ckpts = s3lib.Location(BUCKET, "bench/fsdp/checkpoints/")
    retry = lambda call, *a, **k: call(*a, **k)  # noqa: E731
    manifest, problem = remote_checkpoints.manifest_of(s3, ckpts, "step-00000001", retry)
    assert problem is None and manifest, problem
    result = {"node_bytes": [], "node_s": []}
    for ranks in ((0, 1, 2), (1, 1, 2), None):
        target = folder / f"node-{ranks}"
        started = time.monotonic()
        assert remote_checkpoints.fetch(s3, ckpts, "step-00000001", manifest, target, retry, ranks) is None
        took = time.monotonic() - started
        held = sum(p.stat().st_size for p in (target / "step-00000001").iterdir() if p.name != "manifest.json")
        if ranks:
            result["node_bytes"].append(held)
            result["node_s"].append(took)
        else:
            result.update(whole_bytes=held, whole_s=took)
        shutil.rmtree(target)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", default="measure", choices=["measure", "worker"])
    parser.add_argument("args", nargs="*")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.what == "worker":
        mode, out, endpoint = args.args
        worker(mode, Path(out), endpoint, args.quick)
        return 0
    import boto3

    from podlab import local_s3

    with local_s3() as endpoint, tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        figures = measure(boto3.client("s3", endpoint_url=endpoint), endpoint, Path(tmp), args.quick)
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
