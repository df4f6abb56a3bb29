"""Figures for the README, measured on this machine, as ratios within one run where it matters.

    .venv/bin/python scripts/benchmark.py checkpoint        # GPT-2 124M: save, verify, load
    sudo .venv/bin/python scripts/benchmark.py restart      # a pod's restart: phases vs. bytes

checkpoint: builds config/conf.yaml's model (GPT-2 124M) on the CPU, takes one AdamW step so the
optimizer state is real, then commits a checkpoint the way train.py does (torch.save through the
hashing writer, fsync, manifest last), verifies it and loads it back. The save must fit well inside
torchrun's 30 s between SIGTERM and SIGKILL.

restart: trains a ~13M-parameter model for 2 steps through the real job.yaml (local pod runner,
local S3), then starts the Job's next pod with one more step to do, and compares each phase of
that restart with the time `aws s3 cp --recursive` takes to move the same checkpoint bytes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # podlab puts code/ there too
from podlab import BUCKET, ROOT, Run, local_s3, venv_path  # noqa: E402


def bench_checkpoint() -> None:
    import torch

    import checkpoint
    import config
    from model import GPT

    cfg = config.load(ROOT / "config" / "conf.yaml")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    optimizer = model.make_optimizer(0.1, 6e-4, (0.9, 0.95), "cpu")
    x = torch.randint(0, cfg.model.vocab_size, (1, 64))
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    folder = Path(tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR")))
    final = folder / checkpoint.step_dir_name(1)
    started = time.monotonic()
    with checkpoint.stage(final) as staged:
        with staged.open("model.pt") as file:
            torch.save(model.state_dict(), file)
        with staged.open("state.pt") as file:
            torch.save({"optimizer": optimizer.state_dict(), "step": 1}, file)
        staged.commit(meta={"step": 1})
    saved = time.monotonic() - started
    size = sum(p.stat().st_size for p in final.iterdir())
    started = time.monotonic()
    assert checkpoint.verify(final) is None
    verified = time.monotonic() - started
    started = time.monotonic()
    model.load_state_dict(torch.load(final / "model.pt", weights_only=True))
    optimizer.load_state_dict(torch.load(final / "state.pt", weights_only=True)["optimizer"])
    loaded = time.monotonic() - started
    shutil.rmtree(folder)
    print(f"GPT-2 124M ({model.num_params() / 1e6:.1f}M parameters), checkpoint {size / 1e9:.2f} GB on {folder.parent}:")
    print(f"  save (serialize + sha256 + fsync + manifest + rename): {saved:.1f} s ({size / 1e6 / saved:.0f} MB/s)")
    print(f"  verify (sha256 of every file):                        {verified:.1f} s")
    print(f"  load (weights and optimizer state):                   {loaded:.1f} s")


PHASE = re.compile(r"script: (.+): done in ([\d.]+)s")


def bench_restart() -> None:
    import boto3

    os.environ["PATH"] = venv_path()
    with local_s3() as endpoint:
        measure_restart(boto3.client("s3", endpoint_url=endpoint), endpoint)


def measure_restart(s3, endpoint: str) -> None:
    folder = Path(tempfile.mkdtemp())
    run = Run(s3, endpoint, folder, name="bench", train__max_steps=2, checkpoint__interval=1, eval__interval=1,
              model__n_layer=4, model__n_embd=512, model__n_head=8, model__block_size=64).stage()
    code, pod = run.run()
    assert code == 0, pod.output[-3000:]
    s3.delete_object(Bucket=BUCKET, Key=f"{run.prefix}COMPLETE")
    code, pod = run.run(TRAIN_ARGS="--set train.max_steps=3")
    assert code == 0, pod.output[-3000:]
    phases = {m.group(1): float(m.group(2)) for m in map(PHASE.search, pod.lines) if m}
    ready = float(re.search(r"ready: ([\d.]+)s", pod.output).group(1))
    size = sum(o["Size"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{run.prefix}checkpoints/step-00000002/")["Contents"])
    started = time.monotonic()
    subprocess.run(["aws", "s3", "cp", "--recursive", "--quiet", f"{run.output_uri}checkpoints/step-00000002/",
                    str(folder / "raw")], check=True)
    raw = time.monotonic() - started
    print(f"restart of a pod with a {size / 1e6:.0f} MB checkpoint in S3 (local S3 on loopback):")
    for name, seconds in phases.items():
        print(f"  {name:<22} {seconds:5.1f} s")
    print(f"  start to training      {ready:5.1f} s")
    print(f"  plain `aws s3 cp` of the same checkpoint: {raw:.1f} s; restore/raw = {phases['restore checkpoint'] / raw:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["checkpoint", "restart"])
    args = parser.parse_args(argv)
    bench_checkpoint() if args.what == "checkpoint" else bench_restart()
    return 0


if __name__ == "__main__":
    sys.exit(main())
