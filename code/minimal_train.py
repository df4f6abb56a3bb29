"""The smallest trainer that keeps the pod's contract: copy it, then put your model and data in.

    python minimal_train.py --config config/minimal.yaml --data_dir DATA --output_dir OUT

The same command on every start: it resumes from the newest committed checkpoint, commits one every
`save_every` steps (manifest last) and on SIGTERM or SIGINT (exits 143 or 130), touches $HEALTH_FILE,
writes progress.json. Batches are drawn by step and the RNG is saved: resume is bitwise exact on CPU.
"""
import argparse
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

import checkpoint  # the runtime's (job/checkpoint.py): on the pod's PYTHONPATH; stage.sh puts a copy beside

SETTINGS = {"max_steps": 200, "save_every": 20, "keep": 3, "lr": 1e-3, "batch_size": 32, "context": 8, "seed": 0}
stop = []  # not empty once SIGTERM (a preemption, the pod deleted) or SIGINT came: the pod forwards both
for stop_signal in (signal.SIGTERM, signal.SIGINT):
    signal.signal(stop_signal, lambda signum, frame: stop.append(signum))


def load_settings(path: str) -> dict:
    loaded = yaml.safe_load(Path(path).read_text()) or {}
    unknown = sorted(set(loaded) - set(SETTINGS))
    if unknown or int(os.environ.get("WORLD_SIZE", 1)) > 1:  # bad input: exit 64, which the Job never retries
        why = f"unknown setting {unknown[0]} in {path}" if unknown else "one process only: set NPROC_PER_NODE=1"
        print(f"error: {why}; settings: {', '.join(SETTINGS)}", file=sys.stderr)
        sys.exit(64)
    return {**SETTINGS, **loaded}


def batch(tokens: np.ndarray, s: dict, step: int):  # windows seeded by the step: a resumed run draws the same
    generator = torch.Generator().manual_seed(s["seed"] * 1_000_003 + step)
    starts = torch.randint(len(tokens) - s["context"] - 1, (s["batch_size"],), generator=generator).tolist()
    windows = torch.from_numpy(np.stack([tokens[i:i + s["context"] + 1] for i in starts]).astype(np.int64))
    return windows[:, :-1], windows[:, -1]  # (B, context) tokens, (B,) the next one


def save(out: Path, step: int, model, optimizer, s: dict, loss: float) -> None:
    with checkpoint.stage(out / "checkpoints" / checkpoint.step_dir_name(step)) as staged:
        with staged.open("model.pt") as file:
            torch.save(model.state_dict(), file)
        with staged.open("state.pt") as file:
            torch.save({"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(), "step": step}, file)
        staged.commit(meta={"step": step, "keep": s["keep"]})  # manifest.json last, then renamed into place
    checkpoint.prune(out / "checkpoints", s["keep"])
    (out / "progress.tmp").write_text(json.dumps({"step": step, "max_steps": s["max_steps"], "train_loss": loss}))
    os.replace(out / "progress.tmp", out / "progress.json")  # whole or not at all
    print(f"step {step}/{s['max_steps']}: loss {loss:.4f}, committed", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--config", "--data_dir", "--output_dir"):  # what the pod passes (--model_dir with S3_MODEL_URI)
        parser.add_argument(name, required=True)
    args = parser.parse_args()
    s, out, health = load_settings(args.config), Path(args.output_dir), os.environ.get("HEALTH_FILE")
    if not (Path(args.data_dir) / "train.bin").is_file():  # on the pod the data sync says so first
        print(f"error: no train.bin in {args.data_dir}; make one with scripts/prepare_data.py", file=sys.stderr)
        return 64
    tokens = np.memmap(Path(args.data_dir) / "train.bin", dtype=np.uint16, mode="r")
    vocab = int(tokens.max()) + 1
    torch.manual_seed(s["seed"])
    model = nn.Sequential(nn.Embedding(vocab, 32), nn.Flatten(), nn.Linear(32 * s["context"], 256), nn.GELU(),
                          nn.Dropout(0.1), nn.Linear(256, vocab))  # (B, context) -> (B, vocab) logits
    optimizer = torch.optim.AdamW(model.parameters(), lr=s["lr"])
    step = 0
    checkpoint.remove_staging_leftovers(out / "checkpoints")  # a save cut short by a lost node
    verified = checkpoint.read_verified(os.environ.get("RESTORE_VERIFIED_FILE"))  # the pod's restore hashed it
    folder = checkpoint.newest_valid(out / "checkpoints", verified=verified, on_skip=lambda f, why: print(f.name, why))
    if folder:
        model.load_state_dict(torch.load(folder / "model.pt", weights_only=True))
        state = torch.load(folder / "state.pt", weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])  # dropout draws go on as if never stopped
        step = state["step"]
        print(f"resumed from {folder.name}", flush=True)
    while step < s["max_steps"]:
        x, y = batch(tokens, s, step + 1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if health:
            Path(health).touch()  # the liveness probe: steps are completing
        signalled = stop[0] if stop else 0  # read once: a signal after this is seen at the next step
        if signalled or step % s["save_every"] == 0 or step == s["max_steps"]:
            save(out, step, model, optimizer, s, loss.item())
        if signalled:
            return 128 + signalled  # 143 or 130: this step is committed
    return 0


if __name__ == "__main__":
    sys.exit(main())
