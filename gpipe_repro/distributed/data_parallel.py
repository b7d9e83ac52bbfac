"""Gradient all-reduce between the R replicas of a stage, and synchronized BatchNorm statistics.

**What is reduced, and why a sum.** With R replicas the mini-batch of N examples is cut into R x M
micro-batches (``torch.tensor_split``: sizes differ by at most one) and replica r runs micro-batches
``r*M .. r*M + M - 1``. Each micro-batch's loss is weighted n_m / N with the *global* N (a mean loss)
or 1 (a sum, or a ``(sum, count)`` loss whose count is summed over every rank at AGREE), so a
replica's accumulated gradient is its share of the full-batch gradient and the all-reduce SUMS the
shares. For equal slices this is what DDP's average of per-replica mean gradients computes; for
uneven slices (N not a multiple of R x M) the sum stays exactly the full-batch gradient where the
average of means would not.

**Buckets and overlap.** The stage's parameters are packed, in reverse order (DDP's order: the last
layers' gradients are produced first by a backward), into buckets of at most ``bucket_cap_mb``
megabytes; each bucket is one flat tensor and one asynchronous ``all_reduce`` on the stage's
data-parallel group. A gradient is final when the stage's last backward of the step has accumulated
into it. The runtime calls :meth:`GradientReducer.arm` right before that action: from then on a
post-accumulate-grad hook on every parameter marks it final, and a bucket whose parameters are all
final is launched at once, during the backward, as DDP's reducer does. Buckets are launched strictly
in bucket order (every replica must issue its collectives in the same order), so a bucket ready early
waits for the ones before it. Right after the action, :meth:`GradientReducer.start` launches whatever
is left (parameters that got no gradient in that backward). The all-reduces then run while the stage
sends its last gradient and while the earlier stages are still draining (stage s's all-reduce
overlaps the backwards of stages 0..s-1). :meth:`GradientReducer.finish` waits for them at AGREE,
before the gradient norm is taken, so clipping, the fp16 overflow check and the update all see the
reduced gradients.

A parameter whose gradient is None on every replica (it took no part in the step) keeps None: each
bucket carries one presence flag per parameter.

**Gradients as views of the buckets** (DDP's ``gradient_as_bucket_view=True``). Each bucket is one
flat tensor kept for the whole run. At launch a gradient is copied into its place there (unless it
already is that place), and after the all-reduce ``p.grad`` *is* that place: a view of the bucket,
summed in place. So a step costs one copy of the gradients into the bucket, against a fresh
concatenation (allocated and first touched every step) and a copy back before; autograd still
makes each step's gradients anew (the engine starts every step with ``p.grad = None``). The catch
is DDP's: a reference to ``p.grad`` kept past the next step sees that step's gradient.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from gpipe_repro.distributed.watchdog import PeerFailure
from gpipe_repro.engine.backward_split import SHARES_SAFE
from gpipe_repro.engine.batchnorm import DeferredBatchNorm

__all__ = ["GradientReducer", "sync_batchnorm_stats", "BATCHNORM_STATS", "DEFAULT_BUCKET_CAP_MB"]

DEFAULT_BUCKET_CAP_MB = 25.0   # torch.nn.parallel.DistributedDataParallel's default bucket_cap_mb
BATCHNORM_STATS = ("per_replica", "synchronized")


def make_buckets(params: Sequence[nn.Parameter], cap_bytes: float) -> list[list[nn.Parameter]]:
    """Parameters in reverse order, grouped by (device, dtype), cut into buckets of at most
    `cap_bytes` (a parameter larger than that is a bucket of its own)."""
    buckets: list[list[nn.Parameter]] = []
    open_: dict[tuple[torch.device, torch.dtype], tuple[list[nn.Parameter], int]] = {}
    for p in reversed(list(params)):
        key = (p.device, p.dtype)
        bucket, size = open_.get(key, ([], 0))
        nbytes = p.numel() * p.element_size()
        if bucket and size + nbytes > cap_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(p)
        open_[key] = (bucket, size + nbytes)
    buckets.extend(b for b, _ in open_.values() if b)
    return buckets


class GradientReducer:
    """Sums one stage's gradients over its data-parallel group (see the module docstring).

    Args:
        params: the stage's parameters.
        group: the stage's data-parallel process group (None: the default group).
        ranks: the global ranks of that group (for error messages).
        rank: this process's global rank; timeout_s: how long to wait for a silent replica.
        bucket_cap_mb: the largest bucket, in megabytes (10^6 bytes, as DDP counts).
        names: the parameters by name, for messages.
    """

    def __init__(self, params: Sequence[nn.Parameter], *, group: dist.ProcessGroup | None,
                 ranks: Sequence[int], rank: int, timeout_s: float,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                 names: Mapping[str, nn.Parameter] | None = None) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.group, self.ranks, self.rank = group, list(ranks), rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.buckets = make_buckets(params, bucket_cap_mb * 1e6)
        # per bucket: its flat tensor (the parameters' gradients, then one presence flag each and
        # one flag "a parameter was changed in place since the last update"), kept for the run, and
        # each parameter's gradient-shaped view of it
        self._flats = [torch.zeros(sum(p.numel() for p in b) + len(b) + 1, dtype=b[0].dtype,
                                   device=b[0].device) for b in self.buckets]
        self._views: list[list[torch.Tensor]] = []
        for b, flat in zip(self.buckets, self._flats):
            offsets = [0]
            for p in b:
                offsets.append(offsets[-1] + p.numel())
            self._views.append([flat[o:o + p.numel()].view(p.shape) for p, o in zip(b, offsets)])
        self._pending: list[tuple[int, dist.Work | None]] = []
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._final: list[int] = [0] * len(self.buckets)   # parameters final, per bucket
        self._next = 0              # the next bucket to launch (strictly in order)
        self._armed = False
        self.launched_early = 0     # buckets launched during the last backward (by the hooks)
        self.clock: Callable[[], float] | None = None   # set to record when the first bucket left
        self.first_launch: float | None = None
        for b in self.buckets:
            for p in b:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._on_final_grad)
        self._names = {id(p): name for name, p in (names or {}).items()}
        self.settle()

    def settle(self) -> None:
        """Note the parameters' version counters: after each step's update, and as the job begins.
        A bucket whose parameter's counter moved by the next all-reduce (changed in place between
        steps, by the caller or ``load_state_dict`` on one replica) is compared between the
        replicas at :meth:`finish`."""
        self._versions = [[p._version for p in b] for b in self.buckets]

    @property
    def started(self) -> bool:
        """Whether this step's all-reduces were launched (all of them) and not yet waited for."""
        return not self._armed and self._next == len(self.buckets) and bool(self._pending)

    def arm(self) -> None:
        """Called right before the stage's last backward of the step: from now on a parameter whose
        gradient is accumulated is final, and full buckets are launched in order."""
        if self._pending:
            raise RuntimeError("the previous step's gradient all-reduce was never finished")
        self._final = [0] * len(self.buckets)
        self._next, self._armed, self.launched_early, self.first_launch = 0, True, 0, None

    def _on_final_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        i = self._bucket_of[id(p)]
        self._final[i] += 1
        while self._next < len(self.buckets) and self._final[self._next] == len(self.buckets[self._next]):
            self._launch(self._next)
            self._next += 1
            self.launched_early += 1

    # Counted only while armed, during the stage's last backward action (always a W under a
    # zero-bubble schedule): right when a gradient comes in two shares (engine.backward_split).
    setattr(_on_final_grad, SHARES_SAFE, True)

    def start(self) -> None:
        """Launch the all-reduce of every bucket not launched yet, in order (the gradients must be
        final: right after the stage's last backward)."""
        if not self._armed:   # arm() was not called (no backward this step): launch them all
            self.arm()
        self._armed = False
        for i in range(self._next, len(self.buckets)):
            self._launch(i)
        self._next = len(self.buckets)

    def _launch(self, i: int) -> None:
        """Copy bucket `i`'s gradients into its flat tensor (where they are not already there) with
        their presence flags, and launch its all-reduce."""
        if self.first_launch is None and self.clock is not None:
            self.first_launch = self.clock()
        bucket, flat, views = self.buckets[i], self._flats[i], self._views[i]
        for p, view in zip(bucket, views):
            g = p.grad
            if g is None:
                view.zero_()
            elif not _is_view_of(g, view):
                view.copy_(g.detach())
        moved = any(p._version != v for p, v in zip(bucket, self._versions[i]))
        flat[-len(bucket) - 1:] = torch.tensor([0.0 if p.grad is None else 1.0 for p in bucket]
                                               + [1.0 if moved else 0.0], dtype=flat.dtype)
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._pending.append((i, work))

    def finish(self) -> None:
        """Wait for every bucket and write the summed gradients back (raises PeerFailure naming the
        group when a replica does not answer within the timeout)."""
        pending, self._pending = self._pending, []
        moved = []
        for i, work in pending:
            self._wait(work, "summing gradients")
            bucket, flat, views = self.buckets[i], self._flats[i], self._views[i]
            *flags, changed = flat[-len(bucket) - 1:].tolist()
            for p, view, present in zip(bucket, views, flags):
                if present > 0:
                    p.grad = view          # the summed gradient, in place in the bucket
            if changed > 0:
                moved.append(i)
        for i in moved:                    # the same buckets on every replica, in the same order
            self._refuse_diverged(i)

    def _wait(self, work: dist.Work | None, doing: str) -> None:
        if work is None:
            return
        try:
            work.wait(self.timeout)
        except Exception as e:
            raise PeerFailure(
                f"rank {self.rank} lost a replica of its stage (data-parallel group ranks "
                f"{self.ranks}) while {doing} (it died, failed or did not answer "
                f"within {self.timeout.total_seconds():g} s): {e}", None) from e

    def _refuse_diverged(self, i: int) -> None:
        """ValueError, on every replica alike, where bucket `i`'s parameters differ between the
        replicas (an elementwise max and min over them; a parameter changed in place on one replica
        only since the last update)."""
        bucket = self.buckets[i]
        values = torch.cat([p.detach().reshape(-1) for p in bucket])
        high, low = values.clone(), values
        self._wait(dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                   "comparing parameters")
        self._wait(dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group, async_op=True),
                   "comparing parameters")
        same = (high == low) | (high.isnan() & low.isnan())
        differ, offset = [], 0
        for p in bucket:
            if not bool(same[offset:offset + p.numel()].all()):
                differ.append(self._names.get(id(p), f"a parameter of shape {tuple(p.shape)}"))
            offset += p.numel()
        if differ:
            raise ValueError(
                f"parameter(s) {', '.join(repr(d) for d in differ[:4])}{' ...' if len(differ) > 4 else ''} "
                f"differ between the replicas of this stage (ranks {self.ranks}) as this step reaches "
                "its update: changed in place on some replicas only since the last update (between "
                "steps, or by load_state_dict or load_training_state on one replica). The step is "
                "refused before any update. Change parameters alike on every replica, and load each "
                "rank's own training state")

    def discard(self) -> None:
        """Forget launched all-reduces (a failed step); the job is ending anyway."""
        self._pending, self._armed, self._next = [], False, 0


def _is_view_of(g: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether gradient `g` already is `view`'s place in its bucket (the previous step's summed
    gradient, accumulated into in place)."""
    return (g.data_ptr() == view.data_ptr() and g.shape == view.shape and g.stride() == view.stride()
            and g.dtype == view.dtype and g.device == view.device)


def sync_batchnorm_stats(module: nn.Module, group: dist.ProcessGroup | None, replicas: int) -> None:
    """Merge every DeferredBatchNorm's pending statistics of this step over the data-parallel group
    (collective over `group`), so every replica commits those of the whole global mini-batch.

    Merging uses Chan, Golub & LeVeque's pairwise update ("Algorithms for computing the sample
    variance", 1983), the same rule DeferredBatchNorm applies between micro-batches, in replica order.
    """
    for bn in (m for m in module.modules() if isinstance(m, DeferredBatchNorm)):
        if not bn.track_running_stats:
            continue
        c = bn.num_features
        device = bn.running_mean.device if bn.running_mean is not None else torch.device("cpu")
        mine = torch.zeros(1 + 2 * c, dtype=torch.float64, device=device)
        merged = bn.pending_statistics()
        if merged is not None:
            mine[0] = merged[0]
            mine[1:1 + c] = merged[1].to(device)
            mine[1 + c:] = merged[2].to(device)
        everyone = [torch.empty_like(mine) for _ in range(replicas)]
        dist.all_gather(everyone, mine, group=group)
        count, mean, m2 = 0.0, torch.zeros(c, dtype=torch.float64, device=device), \
            torch.zeros(c, dtype=torch.float64, device=device)
        for t in everyone:
            n = float(t[0])
            if n == 0:
                continue
            tm, tm2 = t[1:1 + c], t[1 + c:]
            if count == 0:
                count, mean, m2 = n, tm.clone(), tm2.clone()
                continue
            total = count + n
            delta = tm - mean
            mean = mean + delta * (n / total)
            m2 = m2 + tm2 + delta * delta * (count * n / total)
            count = total
        if count > 0:
            bn.replace_pending_statistics(int(count), mean, m2)
