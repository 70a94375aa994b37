"""More than one process: data parallel training and evaluation under torchrun, FSDP for the frozen base.

`torchrun --nproc_per_node N -m capt train ...` starts N copies of the same command; each one
joins the process group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) with NCCL on CUDA and gloo on the CPU (start). The models and
methods know nothing of this: the trainer and the evaluation call the few functions here, and
they work as well under a process group the caller started (torch.distributed.init_process_group).

- Training (capt/trainer.py: Trainer._step): every rank builds the same global batches from the
  seed (their order does not depend on the number of ranks) and takes its own part of each
  (shard_of: every N-th example; the parts differ in size by at most one; none is dropped). A rank
  divides its part's summed loss by the global number of examples of the step, so the sum of
  the ranks' gradients is the one-process gradient; sum_gradients adds them up in one
  all-reduce of the few trained tensors, flattened, with the loss in the same buffer. DDP was
  measured against it and is no faster (bench/data_parallel.py, docs/distributed.md); it would also have to
  own every forward call, which the loss, the linear head and T5's encode / decode do not make.
- Evaluation (capt/evaluate.py: candidate_scores): the split is cut into the same batches as in
  one process and the batches are dealt to the ranks in turn, so every example is scored in the
  same batch as in one process; gather_rows sums the ranks' score rows (each row is filled by one
  rank and zero elsewhere, so the sum is exact) and every rank computes the metrics over the
  whole split.
- Decisions (early stopping, what a run directory holds) are taken by rank 0 and sent to the
  others (from_lead); only rank 0 writes files.
- FSDP (shard_model): every linear layer inside the model's blocks is one FSDP2 unit
  (torch.distributed.fsdp.fully_shard), and the model itself one more for the rest (embeddings,
  norms, the output matrix, T5's position-bias tables). A whole block cannot be one unit: T5's
  stacks read block 0's position-bias table before block 0 runs. The method's tensors are left
  out and stay whole on every rank. Under FSDP every rank must run the same forward and backward
  passes, so a rank whose part of a batch is empty runs one example at weight 0, and ranks with
  fewer evaluation batches score a spare one whose result is dropped.
- A collective that fails (another rank died, or did not answer within the timeout) raises
  RankLost, a CaptError: one line, and the run directory holds the last saved state.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

from .errors import CaptError

DEFAULT_TIMEOUT = 600.0  # seconds a rank waits for the others in a collective before giving up
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
FORWARD_METHODS = ("encode", "decode")  # T5's entry points that evaluation calls besides forward


_joined = False  # whether start() started the process group (stop() leaves only that one)


class RankLost(CaptError):
    """A collective failed: another rank ended or stopped answering."""


@dataclass(frozen=True)
class World:
    """This process's place among the ranks (rank 0 of 1 without a process group)."""

    rank: int = 0
    size: int = 1
    backend: str | None = None  # "gloo" / "nccl"; None: no process group

    @property
    def lead(self) -> bool:
        """Rank 0: the one that decides, logs and writes files."""
        return self.rank == 0


def current() -> World:
    """The process group torch.distributed holds (capt's start() or the caller's own), or one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    return World(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))


def local_rank(text) -> int:
    """torchrun's LOCAL_RANK, a whole number from 0."""
    if not str(text).isdigit():
        raise CaptError(f"LOCAL_RANK is {str(text)!r}, not a whole number from 0: start capt with torchrun")
    return int(text)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def start(device: str, timeout: float = DEFAULT_TIMEOUT) -> World:
    """Join the process group of torchrun's environment (NCCL for a CUDA device, gloo otherwise).

    Without torchrun's variables this is one process and nothing starts. `timeout`: seconds a
    collective waits for the other ranks before it fails (RankLost)."""
    if not launched_by_torchrun() or dist.is_initialized():
        return current()
    missing = [v for v in TORCHRUN_VARIABLES if v not in os.environ]
    if missing:
        raise CaptError(f"RANK and WORLD_SIZE are set but not {', '.join(missing)}: start capt with torchrun")
    if not timeout > 0:
        raise CaptError(f"the timeout must be positive, got {timeout}")
    cuda = torch.device(device).type == "cuda"
    local = local_rank(os.environ["LOCAL_RANK"])
    if cuda:
        if local >= torch.cuda.device_count():
            raise CaptError(f"LOCAL_RANK {local} but this machine has {torch.cuda.device_count()} CUDA GPU(s): "
                            "give torchrun --nproc_per_node at most that many")
        torch.cuda.set_device(local)
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    # A rank that reaches a port another program holds waits in torch's handshake with no timeout of its own:
    # a watchdog ends the process after `timeout` seconds, with one line, if the rendezvous has not finished.
    watchdog = threading.Timer(timeout, _give_up_joining, (where, timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout),
                                device_id=torch.device("cuda", local) if cuda else None)
    except (RuntimeError, ValueError) as e:  # the rendezvous failed (address, port, a missing rank)
        raise RankLost(f"cannot join the other ranks at {where}: {first_line(e)}") from None
    finally:
        watchdog.cancel()
    global _joined
    _joined = True
    return current()


def _give_up_joining(where: str, timeout: float) -> None:
    """The watchdog of start(): the rendezvous is stuck, and the main thread cannot be interrupted inside it."""
    print(f"capt: error: rank {os.environ.get('RANK')} could not join the other ranks at {where} within {timeout:g} s "
          "(--dist-timeout): another program may hold the port (choose a free MASTER_PORT), or rank 0 did not start",
          file=sys.stderr, flush=True)
    os._exit(1)


def stop(together: bool = False) -> None:
    """Leave the process group start() joined (one the caller started is the caller's to end).

    together: wait for every rank first (a command that succeeded everywhere). A rank that tears
    its connections down while another still reads them can bring that one down (gloo aborts
    about one exit in ten otherwise); after an error there is no waiting, the others may be gone."""
    global _joined
    if _joined and dist.is_initialized():
        if together:
            with collective("the last barrier"):
                dist.barrier()
        dist.destroy_process_group()
    _joined = False


def abandon(status: int) -> None:
    """End this process now, leaving a process group whose peers are gone as it is: gloo can abort
    (SIGABRT) tearing down connections another rank has already closed, which would replace the
    exit status a caller checks. Only for a group start() joined; otherwise returns. Output is
    flushed first; every file capt writes is already complete (written atomically)."""
    if not (_joined and dist.is_initialized()):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def first_line(error: BaseException) -> str:
    """The gist of an error from torch.distributed: the first sentence of its first line."""
    text = str(error).strip()
    return text.splitlines()[0].split(". ")[0].rstrip(".") if text else type(error).__name__


def backend_error(error: BaseException) -> bool:
    """Whether an error comes from the communication backend (gloo raises plain RuntimeErrors)."""
    return isinstance(error, dist.DistError) or any(word in str(error) for word in ("gloo", "NCCL", "ProcessGroup"))


@contextlib.contextmanager
def collective(what: str, inside_model: bool = False):
    """Turn a failed collective into RankLost: one line, not a hang nor a traceback.

    inside_model: the block runs the model (under FSDP its passes hold collectives), whose own
    errors pass through; only the backend's become RankLost."""
    try:
        yield
    except RuntimeError as e:
        world = current()
        if world.size == 1 or (inside_model and not backend_error(e)):
            raise
        raise RankLost(f"rank {world.rank} of {world.size} lost the other ranks during {what} (one of them ended "
                       f"or did not answer in time: {first_line(e)})") from None


def rank_device(device: str) -> str:
    """The device of this rank: under a process group of several ranks a CUDA device is cuda:LOCAL_RANK."""
    world = current()
    parsed = torch.device(device)
    if world.size == 1 or parsed.type != "cuda":
        return device
    local = local_rank(os.environ.get("LOCAL_RANK", world.rank))
    if parsed.index is not None and parsed.index != local:
        raise CaptError(f"device {device}: under torchrun each rank uses cuda:LOCAL_RANK (here cuda:{local}); give "
                        "--device cuda")
    return f"cuda:{local}"


# ---------------------------------------------------------------------------------------------
# Batches, gradients, scores, decisions


def shard_of(items: list, world: World) -> list:
    """This rank's part of a global batch: every size-th item from its rank on. The batches are
    sorted by length (trainer.bucketed_batches), so the parts are alike in length and the ranks
    wait little for each other; they differ by at most one item, the first len(items) % size
    ranks taking one more; with fewer items than ranks some parts are empty."""
    return items[world.rank::world.size]


def _device(backend: str | None) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def sum_gradients(params: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
    """Sum the trained tensors' gradients and the scalar `loss` over the ranks, in one all-reduce.

    A tensor without a gradient here (no example on this rank) counts as zeros; afterwards every
    rank holds the same summed gradients. Returns the summed loss as a tensor, not read back (the
    trainer reads its losses every few steps)."""
    world = current()
    if world.size == 1:
        return loss
    device = _device(world.backend)
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float().to(device) for p in params]
        + [loss.reshape(1).float().to(device)]
    )  # (sum of numel + 1,)
    with collective("the gradient all-reduce"):
        dist.all_reduce(flat)
    at = 0
    for p in params:
        p.grad = flat[at:at + p.numel()].view_as(p).to(p.device, p.dtype)
        at += p.numel()
    return flat[-1]


def gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Sum (N, ...) rows over the ranks, where each row was filled by one rank and is zero on the
    others: every rank gets all of them, exactly (adding zeros changes no value)."""
    world = current()
    if world.size == 1:
        return rows
    summed = rows.to(_device(world.backend))
    with collective("gathering evaluation scores"):
        dist.all_reduce(summed)
    return summed.to(rows.device)


def from_lead(decide, *args):
    """Run decide(*args) on rank 0 only; every rank returns its result, or raises its CaptError.

    For what one process must settle and the others follow: reading the run directory, early
    stopping. The result goes through pickle (small objects: settings, a training state). Any other
    error on rank 0 is raised there as it is, and on the other ranks as one CaptError naming it, so
    no rank is left waiting for a broadcast that never comes."""
    world = current()
    if world.size == 1:
        return decide(*args)
    box, failure = [None], None
    if world.lead:
        try:
            box[0] = ("ok", decide(*args))
        except CaptError as e:
            box[0] = ("error", type(e), str(e))
        except Exception as e:
            failure = e
            box[0] = ("error", CaptError, f"rank 0 failed: {type(e).__name__}: {e}".splitlines()[0])
    with collective("a broadcast from rank 0"):
        dist.broadcast_object_list(box, src=0, device=_device(world.backend))
    if failure is not None:
        raise failure
    if box[0][0] == "error":
        kind = box[0][1] if isinstance(box[0][1], type) and issubclass(box[0][1], CaptError) else CaptError
        raise kind(box[0][2])
    return box[0][1]


def agree(what: str, value: dict) -> None:
    """Go on only if every rank holds the same `value` as rank 0 (its options and the fingerprints of its data
    and weights): ranks started with different --data, --seed or --lr would otherwise make one run of
    different inputs, with no error. Every rank sees every value, so all of them stop together."""
    world = current()
    if world.size == 1:
        return
    values: list = [None] * world.size
    with collective(f"comparing the ranks' {what}"):
        dist.all_gather_object(values, value)
    differ = {
        rank: sorted(k for k in set(v) | set(values[0]) if v.get(k) != values[0].get(k))
        for rank, v in enumerate(values)
        if v != values[0]
    }
    if differ:
        named = "; ".join(f"rank {rank}: {', '.join(keys)}" for rank, keys in differ.items())
        raise CaptError(f"the ranks were started with other {what} than rank 0 ({named}): every rank must be given "
                        "the same command and the same files")


# ---------------------------------------------------------------------------------------------
# FSDP


def is_sharded(model) -> bool:
    return isinstance(model, FSDPModule)


def shard_model(model: nn.Module, keep=(), device: str | None = None) -> nn.Module:
    """Shard the frozen base across the ranks with FSDP2, in place; the tensors in `keep` (the
    method's, if one is attached) stay whole on every rank, as do tensors attached later.

    Units: every nn.Linear inside the model's block lists, then the model itself. The model's
    weights may be on the CPU: fully_shard moves each unit's shard to the device of `device`
    (default: this rank's CUDA device under NCCL, else the CPU)."""
    world = current()
    if world.backend is None:
        raise CaptError("--fsdp shards the model across the ranks of a process group: start capt with torchrun")
    if is_sharded(model):
        return model
    kind = torch.device(device).type if device is not None else _device(world.backend).type
    mesh = init_device_mesh(kind, (world.size,))
    keep = set(keep)
    with torch.no_grad():  # fully_shard moves what it shards; the kept tensors go to the same device here
        for p in keep:
            p.data = p.data.to(_device(world.backend) if kind == "cuda" else "cpu")
    blocks = [m for m in model.modules() if isinstance(m, nn.ModuleList)]  # the stacks (and T5's sub-layer lists)
    units = {id(m): m for stack in blocks for m in stack.modules() if isinstance(m, nn.Linear)}
    for unit in units.values():
        fully_shard(unit, mesh=mesh, ignored_params=keep or None)
    fully_shard(model, mesh=mesh, ignored_params=keep or None)
    for name in FORWARD_METHODS:  # entry points other than forward gather the root's weights too
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    return model


@contextlib.contextmanager
def whole(model):
    """The model's own (root) weights gathered for the block, for code that reads them outside a
    forward pass (prompt tuning draws its initial rows from the input embedding); a no-op unless sharded."""
    if not is_sharded(model):
        yield
        return
    with collective("gathering the model's weights"):
        model.unshard()
    try:
        yield
    finally:
        model.reshard()
