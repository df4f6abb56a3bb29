"""`scripts/submit.py --check`: what a run's pods would refuse, found from a laptop before the
first GPU minute. One line per finding on stdout (ok, warning, error), then a verdict.

    check(documents) -> exit code     # documents: the workload submit.py renders

In the order a pod meets them: the settings in the pod's env (control characters, names a typo
away from a setting, TRAIN_ARGS that cannot be split); the S3 URIs, listed with this machine's
credentials; the code there (TRAIN_SCRIPT, TRAIN_CONFIG); the staged config with TRAIN_ARGS, checked
by this checkout's trainer (`--check`, for NNODES x NPROC_PER_NODE processes; a trainer of one's own
checks itself when it starts); the data (train.py: train.bin and val.bin of whole uint16 tokens,
longer than model.block_size, meta.json's vocabulary within model.vocab_size; another trainer: not
empty); the model snapshot (config.json); the output (COMPLETE there: the pods would exit 0 at once).

Nothing is written to S3, and nothing staged there is run here: the config file is read as data.
Exit 0: nothing a pod would refuse (warnings allowed); 64: something it would; 75: S3 unreachable.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "job"))
import contract  # noqa: E402 - the settings' names, exit codes
import s3_errors  # noqa: E402 - the one table of S3 errors
import train_args  # noqa: E402 - TRAIN_ARGS split as the pod splits it

CHECKED_TRAINERS = ("train.py", "finetune.py")  # those with --check (job/script.sh: trainer_has_check)
MAX_CONFIG_BYTES = 1 << 20
MAX_LISTED = 10000


class Unavailable(Exception):
    """S3 could not be reached: exit 75."""


class Findings:
    def __init__(self):
        self.errors = self.warnings = 0

    def ok(self, line: str) -> None:
        print(f"ok       {line}", flush=True)

    def warn(self, line: str) -> None:
        self.warnings += 1
        print(f"warning  {line}", flush=True)

    def error(self, line: str) -> None:
        self.errors += 1
        print(f"error    {line}", flush=True)


def check(documents: list[dict]) -> int:
    container = first_container(documents)
    env = pod_env(container)
    said = Findings()
    words = check_settings(env, said)
    try:
        check_s3(env, words, processes(env, container), said)
    except Unavailable as err:
        said.error(str(err))
        print(f"submit.py --check: S3 unreachable: nothing more checked (exit {contract.EXIT_UNAVAILABLE})")
        return contract.EXIT_UNAVAILABLE
    if said.errors:
        print(f"submit.py --check: {said.errors} error(s), {said.warnings} warning(s): the pods would refuse this "
              f"run (exit {contract.EXIT_BAD_INPUT}); fix them, then submit")
        return contract.EXIT_BAD_INPUT
    print(f"submit.py --check: no errors, {said.warnings} warning(s): submit it (--apply)")
    return 0


def pod_env(container: dict) -> dict[str, str]:
    """The container's env values as the pod reads them: '$$' is Kubernetes' escape of '$' (submit.py
    writes every '$' of a flag's value so)."""
    return {e["name"]: e["value"].replace("$$", "$") for e in container.get("env", []) if isinstance(e.get("value"), str)}


def first_container(documents: list[dict]) -> dict:
    """The workload's container, whatever the engine nests it in; a TrainJob's is its runtime's,
    with the TrainJob's trainer env and GPUs over it, as the Trainer makes it."""
    trainjob = next((d for d in documents if d.get("kind") == "TrainJob"), None)
    if trainjob is not None:
        return trainer_container(first_container([d for d in documents if d is not trainjob]), trainjob["spec"]["trainer"])
    stack = list(documents)
    while stack:
        node = stack.pop(0)
        if isinstance(node, dict):
            if isinstance(node.get("containers"), list) and node["containers"]:
                return node["containers"][0]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    raise ValueError("no container in the rendered workload")


def trainer_container(container: dict, trainer: dict) -> dict:
    merged = {**container, "env": list(container.get("env", []))}
    for entry in trainer.get("env", []):
        merged["env"] = [e for e in merged["env"] if e["name"] != entry["name"]] + [entry]
    gpus = (trainer.get("resourcesPerNode") or {}).get("limits", {}).get("nvidia.com/gpu")
    if gpus is not None:
        merged["resources"] = {**container.get("resources", {}), "limits": {**container.get("resources", {}).get(
            "limits", {}), "nvidia.com/gpu": gpus}}
    return merged


def processes(env: dict, container: dict) -> int:
    gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", "1")
    per_node = env.get("NPROC_PER_NODE") or str(gpus)
    nodes = env.get("NNODES") or "1"
    return int(per_node) * int(nodes) if per_node.isdigit() and nodes.isdigit() else 1


# -- settings ---------------------------------------------------------------------------------------

def check_settings(env: dict, said: Findings) -> list[str]:
    """The pod's own checks of its env that need no S3; TRAIN_ARGS as words."""
    bad = [name for name, value in env.items() if name not in contract.SECRET_SETTINGS
           and any(ord(c) < 32 or ord(c) == 127 for c in (value.replace("\n", " ").replace("\t", " ")
                                                            if name == "TRAIN_ARGS" else value))]
    for name in bad:
        said.error(f"{name} holds a control character (a newline or an escape, often pasted); the pod refuses it")
    for name, setting in contract.near_misses(env):
        said.warn(f"{name} is not a setting of the pod, so it is ignored; did you mean {setting}?")
    try:
        words = train_args.split(env.get("TRAIN_ARGS", ""))
    except ValueError as err:
        said.error(str(err))
        words = []
    if not said.errors:
        said.ok(f"settings: {len(env)} in the pod's env")
    return words


# -- S3 ---------------------------------------------------------------------------------------------

class Bucket:
    def __init__(self, client, uri: str):
        self.client, self.uri = client, uri
        self.bucket, _, self.prefix = uri[len("s3://"):].partition("/")

    def call(self, fn, **kwargs):
        import botocore.exceptions

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except botocore.exceptions.NoCredentialsError:
            raise LookupError(s3_errors.explain_code("NoCredentials", self.uri, "local")) from None
        except botocore.exceptions.ClientError as err:
            code = str(err.response.get("Error", {}).get("Code", ""))
            status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            line = s3_errors.explain_code(code, self.uri, "local")
            if line or status < 500:
                raise LookupError(line or f"S3 error {code} on {self.uri}") from None
            raise Unavailable(f"S3 unavailable for {self.uri} ({code})") from None
        except botocore.exceptions.BotoCoreError as err:
            endpoint = os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
            raise Unavailable(f"S3 unreachable at {endpoint} ({type(err).__name__}); check the network or "
                              "AWS_ENDPOINT_URL") from None

    def sizes(self) -> dict[str, int]:
        """Every object under the URI (relative name -> bytes), up to MAX_LISTED."""
        found: dict[str, int] = {}
        token = None
        while len(found) < MAX_LISTED:
            page = self.call(self.client.list_objects_v2, Prefix=self.prefix,
                             **({"ContinuationToken": token} if token else {}))
            found.update({o["Key"][len(self.prefix):]: o["Size"] for o in page.get("Contents", [])})
            token = page.get("NextContinuationToken")
            if not token:
                break
        return found

    def read(self, name: str, limit: int) -> bytes:
        body = self.call(self.client.get_object, Key=self.prefix + name)["Body"]
        return body.read(limit + 1)


def client():
    import boto3
    from botocore.config import Config

    # Few, quick retries: a person is waiting, and an unreachable store should say so soon.
    return boto3.client("s3", config=Config(retries={"mode": "standard", "total_max_attempts": 2},
                                            connect_timeout=5, read_timeout=30))


def listed(s3, uri: str, what: str, said: Findings) -> tuple[Bucket, dict[str, int]] | None:
    place = Bucket(s3, uri if uri.endswith("/") else uri + "/")
    try:
        return place, place.sizes()
    except LookupError as err:
        said.error(f"{what}: {err}")
        return None


def check_s3(env: dict, words: list[str], world_size: int, said: Findings) -> None:
    s3 = client()
    script = env.get("TRAIN_SCRIPT") or "train.py"
    config_file = env.get("TRAIN_CONFIG") or ("config/finetune.yaml" if script == "finetune.py" else "config/conf.yaml")
    code = listed(s3, env.get("S3_CODE_URI", ""), "S3_CODE_URI", said)
    cfg = None
    if code:
        cfg = check_code(code, script, config_file, words, world_size, said)
    data = listed(s3, env.get("S3_DATA_URI", ""), "S3_DATA_URI", said)
    if data:
        check_data(data, script, cfg, said)
    if env.get("S3_MODEL_URI"):
        model = listed(s3, env["S3_MODEL_URI"], "S3_MODEL_URI", said)
        if model:
            check_model(model, said)
    output = listed(s3, env.get("S3_OUTPUT_URI", ""), "S3_OUTPUT_URI", said)
    if output:
        check_output(output, said)


def check_code(code, script: str, config_file: str, words: list[str], world_size: int, said: Findings):
    """The trainer and its config there, and the config with TRAIN_ARGS; the config (train.py's) for the data."""
    place, names = code
    missing = [name for name in (script, config_file) if name not in names]
    if missing:
        said.error(f"{place.uri} holds no {' and no '.join(missing)}; stage the code (scripts/stage.sh "
                   f"{place.uri}) or fix TRAIN_SCRIPT / TRAIN_CONFIG")
        return None
    said.ok(f"{place.uri} holds {script} and {config_file}")
    if script not in CHECKED_TRAINERS:
        said.warn(f"TRAIN_SCRIPT={script} is a trainer of your own: its config and TRAIN_ARGS are checked when it starts")
        return None
    text = place.read(config_file, MAX_CONFIG_BYTES)
    if len(text) > MAX_CONFIG_BYTES:
        said.error(f"{place.uri}{config_file} is over {MAX_CONFIG_BYTES >> 20} MB: not a config")
        return None
    with tempfile.TemporaryDirectory(prefix="submit-check-") as folder:
        staged = Path(folder) / Path(config_file).name
        staged.write_bytes(text)
        return check_config(staged, f"{place.uri}{config_file}", script, words, world_size, said)


def check_config(staged: Path, where: str, script: str, words: list[str], world_size: int, said: Findings):
    """This checkout's trainer --check on the staged file, as the pod runs it; train.py's config loaded."""
    model = ["--model_dir", "/nonexistent"] if script == "finetune.py" else []
    command = [sys.executable, str(ROOT / "code" / script), "--check", "--config", str(staged), *model,
               "--data_dir", "/nonexistent", "--output_dir", "/nonexistent", *words]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT / "code",
                            env={**os.environ, "WORLD_SIZE": str(world_size)})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    last = (lines[-1] if lines else f"exit {result.returncode}").removeprefix("error: ").replace(f"{staged}: ", "")
    last = contract.printable(last)  # it may quote the staged config, which anyone who may write the bucket wrote
    # The pod's words name its env; submit.py's user sets the processes with flags.
    last = last.replace("change it or NPROC_PER_NODE", "change it (--train-args \"--set train.grad_accum_steps=N\") "
                                                        "or --nodes and --gpus-per-node")
    settings = f"{where} with TRAIN_ARGS {contract.printable(shlex.join(words))}" if words else where  # one line
    if result.returncode in (contract.EXIT_BAD_INPUT, 2):  # a setting; an argument argparse refused
        said.error(f"{script} refuses {settings}: {last}")
        return None
    if result.returncode != 0:  # the check itself broke, as the pod would see it: the trainer says more
        said.warn(f"{script} --check failed (exit {result.returncode}: {last}); the trainer checks itself when it starts")
        return None
    said.ok(f"{settings} passes {script} --check for {world_size} process(es)")
    if script != "train.py":
        return None
    sys.path.insert(0, str(ROOT / "code"))
    import config as train_config  # noqa: PLC0415 - the trainer's settings, only when they are train.py's

    return train_config.load(staged, [w.removeprefix("--set=") for w in overrides(words)])


def overrides(words: list[str]) -> list[str]:
    """The --set values among train.py's arguments."""
    found = []
    for i, word in enumerate(words):
        if word == "--set" and i + 1 < len(words):
            found.append(words[i + 1])
        elif word.startswith("--set="):
            found.append(word)
    return found


def check_data(data, script: str, cfg, said: Findings) -> None:
    place, names = data
    if script != "train.py":
        if names:
            said.ok(f"{place.uri}: {len(names)} object(s) ({script} reads its data itself)")
        else:
            said.error(f"{place.uri} is empty; upload the data there")
        return
    problems = []
    for split in ("train", "val"):
        size = names.get(f"{split}.bin")
        if size is None:
            problems.append(f"holds no {split}.bin; make it with scripts/prepare_data.py and stage it there")
        elif size % 2:
            problems.append(f"{split}.bin is {size} bytes, not whole uint16 tokens; make it again with "
                            "scripts/prepare_data.py")
        elif cfg is not None and size // 2 <= cfg.model.block_size + 1:
            problems.append(f"{split}.bin holds {size // 2} tokens, fewer than model.block_size+2 "
                            f"({cfg.model.block_size + 2}); give more data or a smaller block_size")
    vocab = meta_vocabulary(place, names)
    if cfg is not None and vocab is not None and vocab > cfg.model.vocab_size:
        problems.append(f"meta.json's vocabulary ({vocab}) is larger than model.vocab_size ({cfg.model.vocab_size}); "
                        f"set model.vocab_size to at least {vocab}")
    for problem in problems:
        said.error(f"{place.uri}: {problem}")
    if not problems:
        said.ok(f"{place.uri}: train.bin {names['train.bin'] // 2:,} and val.bin {names['val.bin'] // 2:,} tokens"
                + (f", vocabulary {vocab}" if vocab is not None else ""))


def meta_vocabulary(place: Bucket, names: dict[str, int]) -> int | None:
    if "meta.json" not in names or names["meta.json"] > MAX_CONFIG_BYTES:
        return None
    try:
        vocab = json.loads(place.read("meta.json", MAX_CONFIG_BYTES)).get("vocab_size")
    except (ValueError, AttributeError, RecursionError):
        return None
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def check_model(model, said: Findings) -> None:
    place, names = model
    if "config.json" in names:
        said.ok(f"{place.uri} holds a model snapshot ({len(names)} files)")
    else:
        said.error(f"{place.uri} holds no config.json; stage a save_pretrained folder (scripts/stage.sh --model)")


def check_output(output, said: Findings) -> None:
    place, names = output
    if contract.COMPLETE_KEY in names:
        said.warn(f"{place.uri}{contract.COMPLETE_KEY} exists: the run is finished and its pods would exit 0 at "
                  "once; to train it further, raise train.max_steps and remove COMPLETE, or give --output a new "
                  "prefix")
    elif any(name.startswith(contract.CHECKPOINTS_DIR + "/") for name in names):
        said.ok(f"{place.uri}: checkpoints there: the run resumes from the newest")
    else:
        said.ok(f"{place.uri}: a new run")
