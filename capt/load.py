"""Checkpoint directory -> model: config.json picks the family, safetensors fill the weights.

The model is built on the meta device and the checkpoint tensors are assigned into it, so no
weight is ever allocated twice. Loading is strict: every checkpoint tensor is used, every model
tensor is filled, every shape is checked. The only tolerated differences are a checkpoint's
copies of a tied matrix (the model keeps one) and the capsule vectors (not in a base checkpoint).

A method's tensors are saved beside (never inside) the base checkpoint, by one writer and one
reader for every method: capt writes capsules.safetensors (one fp32 vector per block,
`layers.{l}`) and capsules.json (the CapsuleConfig, the base model it fits and the input format
it was trained with); the other methods
adapter.safetensors (their tensors by the names of methods.method_tensors) and adapter.json (the
MethodConfig and the base model).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .models import llama, t5
from .checks import read_json
from .errors import CaptError, CaptWarning
from .hub import resolve_model
from .methods import METHODS, CapsuleConfig, MethodConfig, attach, detach, method_tensors
from .packed import pack_linears

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a checkpoint's tensors may hold


LEGACY_INPUTS = {"answer_cue": False}  # a capsules.json / adapter.json with no "inputs" key: made before the answer cue
FAMILIES = {"t5": t5, "llama": llama, "qwen2": llama}  # config.json's model_type -> the module of its Model and Config


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> str:
    """`device` (None: default_device()), refused in one line when torch cannot run on it here."""
    if device is None:
        return default_device()
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise CaptError(f"device {device!r} is not a torch device (use cpu, cuda or cuda:N)") from None
    if parsed.type not in ("cpu", "cuda"):  # meta holds no values; mps, xpu ... are not supported
        raise CaptError(f"device {device!r} is not supported: capt runs on cpu or cuda (cuda:N)")
    if parsed.type == "cpu" and parsed.index not in (None, 0):
        raise CaptError(f"device {device!r}: the CPU is one device, cpu (an index other than 0 means nothing to torch)")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise CaptError(f"device {device} requested but no CUDA GPU is available")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise CaptError(f"device {device} requested but this machine has {count} CUDA GPU(s): cuda:0 .. "
                            f"cuda:{count - 1}")
    return device


def read_config(path: str | os.PathLike) -> dict:
    """The checkpoint's config.json as a dict, with a clear error when it is missing or broken."""
    path = resolve_model(path)  # a hub id -> its cached snapshot folder
    file = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise CaptError(f"model directory not found: {path}")
    if not file.is_file():
        raise CaptError(f"no config.json in {path}: a checkpoint directory holds config.json and its safetensors")
    config = read_json(file, "a checkpoint's config.json")
    family = config.get("model_type")
    if not isinstance(family, str) or family not in FAMILIES:
        raise CaptError(f"{file}: model_type {family!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return config


def config_hash(path: str | os.PathLike) -> str:
    """sha256 of the checkpoint's config.json bytes: what capsule files are bound to."""
    return hashlib.sha256((resolve_model(path) / "config.json").read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# The weights' fingerprint: what saved methods and runs are bound to, beside config.json's hash

CACHE_NAME = "weights-sha256.json"
CACHE_ENTRIES = 256  # files remembered; the oldest entries go first
RACY_NS = 2_000_000_000  # a file changed this recently is hashed but not remembered: a rewrite within the
# filesystem's timestamp granularity could keep its size and mtime


def cache_dir() -> Path:
    """Where capt keeps its caches: $CAPT_CACHE, else $XDG_CACHE_HOME/capt, else ~/.cache/capt."""
    if os.environ.get("CAPT_CACHE"):
        return Path(os.environ["CAPT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "capt"


def _file_sha256(file: Path, cache: dict) -> str:
    """sha256 of a file's bytes, from `cache` when its real path, size, mtime, ctime and inode are as remembered
    (ctime changes with every write and with every change of mtime, so a rewrite in place that keeps the size and
    sets the old mtime back is read again)."""
    stat = file.stat()
    key, seen = os.path.realpath(file), [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]
    entry = cache.get(key)
    if isinstance(entry, dict) and entry.get("stat") == seen and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    sha = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(1 << 20):
            sha.update(block)
    digest = sha.hexdigest()
    cache.pop(key, None)
    if time.time_ns() - stat.st_mtime_ns > RACY_NS:
        cache[key] = {"stat": seen, "sha256": digest}
    return digest


def weights_fingerprint(path: str | os.PathLike) -> str:
    """The sha256 of a checkpoint directory's weights, as a hex string: the sha256 of model.safetensors (what
    `sha256sum` prints, and the hub's id of the file), or for a sharded checkpoint the sha256 of its shards'
    `sha256sum` lines ("<sha256>  <name>\\n", in the index's order). Each file's hash is remembered by its
    real path, size, mtime, ctime and inode in cache_dir()/weights-sha256.json, so a checkpoint is read through once
    (docs/speed.md says how long that takes); an unwritable cache only costs the reading again."""
    files = safetensors_files(resolve_model(path))
    cache_file = cache_dir() / CACHE_NAME
    try:
        cache = read_json(cache_file, "capt's cache of weight hashes") if cache_file.is_file() else {}
    except CaptError:  # a damaged cache is rebuilt
        cache = {}
    before = dict(cache)
    try:
        hashes = [(_file_sha256(file, cache), file.name) for file in files]
    except OSError as e:
        raise CaptError(f"cannot read the checkpoint's weights in {path}: {e.strerror or e}") from None
    if cache != before:
        kept = dict(list(cache.items())[-CACHE_ENTRIES:])
        try:
            atomic_write(cache_file, lambda tmp: Path(tmp).write_text(json.dumps(kept) + "\n"))
        except (CaptError, OSError):  # a read-only home: the hashes are computed again next time
            pass
    if len(hashes) == 1:
        return hashes[0][0]
    return hashlib.sha256("".join(f"{digest}  {name}\n" for digest, name in hashes).encode()).hexdigest()


def build_model(config: dict, device: torch.device | str = "meta", where: str | os.PathLike = "config.json"):
    """The model for a config dict, its tensors on `device` (meta: no memory at all); `where`, the config's
    path, heads the message of a value the checks refuse."""
    family = FAMILIES[config["model_type"]]
    try:
        settings = family.Config.from_dict(config)  # each field checked (capt/checks.py)
    except CaptError as e:
        text = str(e).removeprefix("config.json: ")
        raise CaptError(f"{where}: {text}") from None
    try:
        with torch.device(device):
            return family.Model(settings)
    # sizes each fine alone whose products overflow a tensor's size
    except (RuntimeError, TypeError, OverflowError) as e:
        raise CaptError(f"{where}: the model's tensors cannot be built at these sizes "
                        f"({str(e).splitlines()[0][:120]})") from None


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """model.safetensors, or the shards a model.safetensors.index.json names."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CaptError(f"{index} is not a valid safetensors index: weight_map must map tensor names to shard file "
                            "names")
        names = list(dict.fromkeys(weight_map.values()))
        for name in names:  # a shard must lie inside the checkpoint: no absolute path, no way up
            if Path(name).is_absolute() or ".." in Path(name).parts or not name:
                raise CaptError(f"{index} names the shard {name!r}, which is outside the checkpoint directory; refused")
        shards = [path / name for name in names]
        for shard in shards:
            if not shard.is_file():
                raise CaptError(f"missing shard {shard.name} (named by {index})")
        return shards
    if single.is_file():
        return [single]
    raise CaptError(f"no model.safetensors or model.safetensors.index.json in {path}")


def read_checkpoint(path, dtype: torch.dtype | None, device) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, cast to dtype (floating tensors only) on device."""
    state, dtypes = {}, {}
    for file in safetensors_files(path):
        if not os.access(file, os.R_OK):
            raise CaptError(f"cannot read {file}: permission denied")
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    if key in state:
                        raise CaptError(f"tensor {key} appears in more than one shard ({file.name})")
                    t = f.get_tensor(key)
                    if t.dtype not in WEIGHT_DTYPES:
                        raise CaptError(f"{file.name}: tensor {key} is {str(t.dtype).replace('torch.', '')}; capt "
                                        "reads float32, "
                                        "bfloat16 or float16 weights (quantized checkpoints are not supported)")
                    if not bool(torch.isfinite(t).all()):
                        raise CaptError(f"{file.name}: tensor {key} holds NaN or infinite values; the checkpoint is "
                                        "damaged")
                    dtypes.setdefault(t.dtype, key)
                    state[key] = t if dtype is None else t.to(dtype)
        except SafetensorError as e:
            raise CaptError(f"{file} is corrupt or truncated: {e}") from None
        except OSError as e:
            raise CaptError(f"cannot read {file}: {e.strerror or e}") from None
    if dtype is None and len(dtypes) > 1:  # one dtype for the whole model, or its matmuls would mix them
        mixed = ", ".join(f"{str(d).replace('torch.', '')} ({k})" for d, k in dtypes.items())
        raise CaptError(f"checkpoint {path} mixes tensor dtypes: {mixed}; load it with dtype fp32 or bf16 to cast them "
                        "all")
    return state


def load_model(path, dtype=None, device=None, capsules=None, any_base: bool = False):
    """Load a Hugging Face checkpoint directory (config.json + safetensors) as a capt model.

    path: the directory, or a hub id "ORG/NAME" (capt/hub.py: from huggingface_hub's cache, else downloaded).
    dtype: None keeps the checkpoint's dtype; "fp32"/"bf16" or a torch dtype casts on load.
    device: where the weights go (default CPU).
    capsules: None; a CapsuleConfig (fresh zero capsules, backbone frozen); the directory of
        saved capsules (capsules.safetensors + capsules.json) made for this base model; or several
        sets at once, {name: directory or CapsuleConfig} (load_capsule_sets), served per row through
        the forward's `tasks`.
    any_base: saved capsules made for another base model of the same sizes (other config.json or
        weights) are used anyway, with a CaptWarning naming the difference; by default they are refused.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise CaptError("load_model: path must be a checkpoint directory or a hub id ORG/NAME, not "
                        f"{type(path).__name__}")
    if capsules is not None and not isinstance(capsules, (CapsuleConfig, dict, str, os.PathLike)):
        raise CaptError(f"load_model: capsules must be a CapsuleConfig, a directory of saved capsules or {{name: "
                        f"directory}}, "
                        f"not {type(capsules).__name__}")
    path = resolve_model(path)  # a hub id -> its cached snapshot folder
    config = read_config(path)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CaptError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype is not None and dtype not in WEIGHT_DTYPES:
        raise CaptError(f"dtype {dtype} is not one capt computes in: use fp32 or bf16 (or torch.float16)")
    device = torch.device(check_device(str(device) if device is not None else "cpu"))
    # the linear layers on oneDNN's packed weights where they serve (capt/packed.py)
    model = pack_linears(build_model(config, "meta", Path(path) / "config.json"))
    state = read_checkpoint(path, dtype, device)

    expected = model.state_dict()  # no capsules yet: they are attached after loading
    aliases = model.checkpoint_aliases()
    unused = model.checkpoint_unused()
    for key in list(state):
        if key in aliases and key not in expected:  # a copy of a tied matrix: the model keeps one
            tensor, target = state.pop(key), aliases[key]
            if tuple(tensor.shape) != tuple(expected[target].shape):
                raise CaptError(f"tensor {key} has shape {tuple(tensor.shape)}, but the config gives "
                                f"{tuple(expected[target].shape)}")
            if target in state and not torch.equal(tensor, state[target]):
                raise CaptError(f"config.json ties {key} to {target}, but the checkpoint holds different values for "
                                "them")
            continue
        if key in unused:  # present in some older conversions, never read by the model
            del state[key]
            continue
        tensor = state[key]
        if key not in expected:
            raise CaptError(f"checkpoint tensor {key} is not part of a {config['model_type']} model with this "
                            "config.json")
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise CaptError(f"tensor {key} has shape {tuple(tensor.shape)}, but the config gives "
                            f"{tuple(expected[key].shape)}")
    missing = [k for k in expected if k not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CaptError(f"checkpoint {path} lacks tensor {missing[0]}{more}")

    model.load_state_dict(state, strict=True, assign=True)  # capsules are attached afterwards
    model.init_buffers(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    model.source = {"path": str(path), "config_sha256": config_hash(path), "weights_sha256": weights_fingerprint(path),
                    "model_type": config["model_type"]}

    if capsules is not None:
        if isinstance(capsules, CapsuleConfig):
            attach(model, "capt", capsules=capsules)
        elif isinstance(capsules, dict):
            load_capsule_sets(model, capsules, any_base)
        else:
            load_method(model, capsules, expect="capt", any_base=any_base)
    return model


# ---------------------------------------------------------------------------------------------
# Method files


def base_description(model) -> dict:
    """The base model a method's tensors are bound to (written in capsules.json / adapter.json): its
    family and sizes, which the tensors must fit, and the hashes of its config.json and its weights
    (weights_fingerprint), which say it is the same model."""
    return {
        "model_type": model.source["model_type"],
        "hidden_size": model.capsule_width,
        "num_layers": len(model.capsule_blocks()),
        "config_sha256": model.source["config_sha256"],
        "weights_sha256": model.source.get("weights_sha256"),
    }


BASE_HASHES = ("config_sha256", "weights_sha256")  # what any_base may let differ: the sizes must always match


def atomic_write(path: Path, write) -> None:
    """Write through `write(tmp_path)` then rename over `path`, so a crash never leaves half a file.

    A write that fails for lack of space (or any OS error) is one CaptError naming the file; the
    previous file stays as it was and the temporary file is removed.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
        os.close(fd)
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes owner-only files; give the usual mode
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        # torch.save and safetensors report a full disk in their own words ("unexpected pos ...")
        full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
            isinstance(e, (OSError, RuntimeError, SafetensorError)) and _free_bytes(path.parent) < 1 << 20)
        if full:
            raise CaptError(
                f"could not write {path}: the disk is full; the previous {path.name}, if any, is kept"
            ) from None
        if isinstance(e, OSError):
            raise CaptError(
                f"could not write {path}: {e.strerror or e}; the previous {path.name}, if any, is kept"
            ) from None
        raise


TMP_SUFFIX = ".tmp"


def _free_bytes(directory: Path) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 1 << 62  # unknown: assume space


def remove_stale_tmp(directory: Path) -> None:
    """Remove the temporary files an interrupted atomic_write left in directory (.NAME.XXXX.tmp)."""
    for stale in Path(directory).glob(f".*{TMP_SUFFIX}"):
        stale.unlink(missing_ok=True)


def save_method(model, directory) -> Path:
    """Write the attached method's tensors (fp32) and description into directory: capsules.* for
    capt, adapter.* for the others. The description names the base model they fit."""
    config = model.method
    if config is None:
        raise CaptError("this model has no method attached: capt.methods.attach(model, method) first")
    if config.task_capsules is not None:
        raise CaptError(f"this model holds {len(config.tasks)} capsule sets ({', '.join(config.tasks)}); "
                        "save_capsules writes a model with one set")
    directory, stem = Path(directory), METHODS[config.method].files
    tensors = {k: t.detach().float().cpu().contiguous() for k, t in method_tensors(model).items()}
    bad = next((k for k, t in tensors.items() if not bool(torch.isfinite(t).all())), None)
    if bad is not None:  # loading would refuse them: never write them
        raise CaptError(f"{bad} holds NaN or infinite values, so it is not written to {directory}; the tensors have "
                        "diverged")
    if stem == "capsules":
        meta = {"capsule_config": config.capsule.to_dict(), "base_model": base_description(model)}
    else:
        meta = {
            "method_config": {k: v for k, v in config.to_dict().items() if k != "inputs"},
            "base_model": base_description(model),
        }
    meta["inputs"] = config.inputs  # the input format they were trained with, evaluation's default (null: not known)
    atomic_write(directory / f"{stem}.safetensors", lambda tmp: save_file(tensors, tmp))
    atomic_write(directory / f"{stem}.json", lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))
    return directory


def save_capsules(model, directory) -> Path:
    """Write capsules.safetensors (`layers.{l}`, fp32, (d,)) and capsules.json into directory."""
    if model.method is None or model.method.method != "capt":
        raise CaptError("this model has no capsules attached: load it with capsules=CapsuleConfig(...)")
    return save_method(model, directory)


def read_method_meta(directory, expect: str | None = None) -> tuple[MethodConfig, dict, Path]:
    """(the saved MethodConfig, its base model description, its tensor file) from capsules.json or
    adapter.json; expect: the method the directory must hold."""
    directory = Path(directory)
    found = [stem for stem in ("capsules", "adapter") if (directory / f"{stem}.json").is_file()]
    if expect == "capt" and "capsules" not in found:
        raise CaptError(f"no capsules.json in {directory}: not a capsule directory")
    if not found:
        raise CaptError(f"no capsules.json or adapter.json in {directory}: not a saved method")
    if len(found) > 1:
        raise CaptError(f"{directory} holds both capsules.json and adapter.json: keep the one you mean in a directory "
                        "of its own")
    file = directory / f"{found[0]}.json"
    meta = read_json(file, "a saved method's description")
    inputs = meta.get("inputs", LEGACY_INPUTS)
    try:
        if found[0] == "capsules":
            config = MethodConfig("capt", capsule=CapsuleConfig.from_dict(meta["capsule_config"]), inputs=inputs)
        else:
            config = MethodConfig.from_dict({**meta["method_config"], "inputs": inputs})
        base = meta["base_model"]
        base["config_sha256"]
    except CaptError as e:  # a value the method's record refuses: say which file holds it
        raise CaptError(f"{file}: {e}") from None
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        what = "capsule" if found[0] == "capsules" else "method"
        raise CaptError(f"{file} is not a valid {what} description ({e!r})") from None
    return config, base, directory / f"{found[0]}.safetensors"


def check_base(base: dict, model, what: str, directory, any_base: bool = False) -> None:
    """Saved tensors fit only the base model they were trained on: the same family and sizes, config.json
    bytes and weights. Files written before the weights' hash was recorded lack it and are bound by the
    rest. any_base: a base with other hashes (same sizes) is used on purpose, with a CaptWarning naming them."""
    mine = base_description(model)
    differ = [
        k for k in mine if base.get(k) != mine[k] and not (k == "weights_sha256" and None in (base.get(k), mine[k]))
    ]
    if not differ:
        return
    shown = ", ".join(f"{k} {str(base.get(k))[:12] if k in BASE_HASHES else repr(base.get(k))} vs "
                      f"{str(mine[k])[:12] if k in BASE_HASHES else repr(mine[k])}" for k in differ)
    if any_base and set(differ) <= set(BASE_HASHES):
        warnings.warn(CaptWarning(f"{what} in {directory} were made for a different base model ({shown}); used anyway, "
                                  "as asked"))
        return
    hint = (
        "; pass --any-base (any_base=True) to use them on this base on purpose"
        if set(differ) <= set(BASE_HASHES)
        else ""
    )
    raise CaptError(f"{what} in {directory} were made for a different base model ({shown}){hint}")


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a small safetensors file (capsules, adapters), on the CPU."""
    if not file.is_file():
        raise CaptError(f"no {file.name} in {file.parent}")
    if not os.access(file, os.R_OK):
        raise CaptError(f"cannot read {file}: permission denied")
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise CaptError(f"{file} is corrupt or truncated: {e}") from None


def fill(tensors: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], file: Path) -> None:
    """Copy saved into the model's tensors after checking that names and shapes match exactly."""
    if set(saved) != set(tensors):
        missing, extra = sorted(set(tensors) - set(saved)), sorted(set(saved) - set(tensors))
        raise CaptError(f"{file} does not match its config: missing {missing or 'none'}, extra {extra or 'none'}")
    for key, p in tensors.items():
        if tuple(saved[key].shape) != tuple(p.shape):
            raise CaptError(f"{file}: {key} has shape {tuple(saved[key].shape)}, expected {tuple(p.shape)}")
    for key, t in saved.items():
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise CaptError(f"{file}: {key} holds NaN or infinite values (or is not a float tensor); refused")
    with torch.no_grad():
        for key, p in tensors.items():
            p.copy_(saved[key])


def load_method(model, directory, expect: str | None = None, any_base: bool = False) -> MethodConfig:
    """Attach the method saved in directory (capsules.* or adapter.*), after checking it was made
    for this base model (any_base: or one of the same sizes, on purpose); expect: the method it must
    be. A failed load leaves the plain backbone."""
    if not isinstance(directory, (str, os.PathLike)):
        raise CaptError(f"a saved method is a directory (str or path), not {type(directory).__name__}")
    config, base, file = read_method_meta(directory, expect)
    if expect is not None and config.method != expect:
        raise CaptError(f"{directory} holds {config.method} tensors, not {expect}")
    what = "capsules" if config.method == "capt" else f"the {config.method} tensors"
    check_base(base, model, what, directory, any_base)
    saved = read_tensors(file)
    attach(model, config)
    try:
        fill(method_tensors(model), saved, file)
    except CaptError:
        detach(model)
        raise
    return config


def load_capsule_sets(model, sets: dict, any_base: bool = False) -> MethodConfig:
    """Attach several capsule sets to one model, {name: directory written by save_capsules, or a
    CapsuleConfig for fresh zeros}: each capsule block gets a (K, d) table, row k for the k-th set
    (model.tasks lists the names in that order). Every directory is checked against this base
    model (any_base: see load_method); the sets must share one integration and may differ in depth. A
    failed load leaves the plain backbone."""
    if not sets:
        raise CaptError("capsules={}: name at least one capsule set, {name: directory}")
    configs, saved = {}, {}
    for name, source in sets.items():
        if isinstance(source, CapsuleConfig):
            configs[name] = source
            continue
        if not isinstance(source, (str, os.PathLike)):
            raise CaptError(f"capsule set {name!r}: give a directory written by save_capsules or a CapsuleConfig, "
                            f"not {type(source).__name__}")
        config, base, file = read_method_meta(source, expect="capt")
        check_base(base, model, f"capsules {name!r}", source, any_base)
        configs[name] = config.capsule
        saved[name] = (read_tensors(file), file)
    config = attach(model, MethodConfig("capt", task_capsules=configs))
    blocks = model.capsule_blocks()
    try:
        for k, name in enumerate(config.tasks):
            if name in saved:
                tensors, file = saved[name]
                rows = {f"layers.{i}": blocks[i].capsule.detach()[k] for i in configs[name].layer_indices(len(blocks))}
                fill(rows, tensors, file)  # row k of each table, a view: the copy lands in the table
    except CaptError:
        detach(model)
        raise
    return config


def trainable_count(
    config: dict,
    method: str | MethodConfig = "capt",
    n: int | None = None,
    num_classes: int | None = None,
    capsules: CapsuleConfig | None = None,
    where: str | os.PathLike = "config.json",
) -> int:
    """Trained parameters of a method on the model of a config.json dict, without any weights (where: the
    config's path, for the message of a value the checks refuse)."""
    model = build_model(config, "meta", where)
    attach(model, method, n, num_classes, capsules)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def count_trainable(path, capsules: CapsuleConfig | None = None, method: str = "capt", n: int | None = None,
                    num_classes: int | None = None) -> int:
    """Trainable parameters for the checkpoint at path, from config.json alone (no weights).

    Capsules by default (a CapsuleConfig, default CapsuleConfig()); method / n / num_classes count
    a baseline of capt.methods instead.
    """
    where = Path(resolve_model(path)) / "config.json"
    return trainable_count(read_config(path), method, n, num_classes, capsules, where)


def trainable_summary(model) -> str:
    """A one-line summary like peft's print_trainable_parameters."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    base = total - trainable
    return (
        f"trainable params: {trainable:,} || base params: {base:,} || trainable%: {100 * trainable / max(base, 1):.4f}"
    )
