"""One run of the learning study (experiments/learning.py): ``Run`` says what it is, ``train`` computes it.

Both methods are computed in one process each, without a network (as equal_tokens.py does, whose arithmetic this
shares), on the default model and the built-in corpus, with the settings the papers tune on (docs/learning.md):

- **the same budget**: ``STEPS`` inner steps per island, ``PEERS`` islands of ``BATCH`` sequences each; sync DP takes
  ``STEPS`` steps at the global batch (``PEERS x BATCH`` sequences, one forward of all of them: the mean of the
  shards' mean losses, as they are equal in size), so both see exactly the same tokens;
- **the same inner lr schedule**: linear warm-up over ``WARMUP`` steps, then a cosine decay to ``FINAL_LR_FRACTION``
  of the peak at the last step, indexed by the inner step (each island's AdamW keeps its state across rounds, as a
  peer's does);
- **the codec on both hops**: a sender's outer gradient goes through the codec (int4 with the sender's error
  feedback, as a peer sends it), the group's mean goes through it again (the reducer's re-encode);
- **one held-out set**: the loss at the end is measured on ``FINAL_EVAL_BATCHES`` batches of 16 held-out sequences
  (the same for every run); the curve on the way on the first 4 of them.

Wire bytes per token count what one peer sends per token it trained: in a butterfly all-reduce of n peers each
sends (n - 1)/n of its outer gradient to the reducers and each reducer sends (n - 1)/n of its averaged part back,
so 2 (n - 1)/n x params x codec bytes per value per round, over H x batch tokens; fp32 sync DP sends the same
every step with 4 bytes per value. The ratio to fp32 sync DP is 4 H / bytes per value.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import torch

from p2p_diloco.core.compression import make_codec
from p2p_diloco.core.config import COMPRESSIONS, INNER_OPTIMIZERS, DataConfig, InnerConfig, ModelConfig, OuterConfig
from p2p_diloco.core.feedback import FEEDBACK_CODECS, ErrorFeedback
from p2p_diloco.core.link import codec_round_trip
from p2p_diloco.core.outer import OuterOptimizer
from p2p_diloco.core.portable import fp32
from p2p_diloco.core.schedule import lr_factor as schedule_factor
from p2p_diloco.train.data import Dataset
from p2p_diloco.train.inner_optimizer import build_inner_optimizer
from p2p_diloco.train.model import build_model

PEERS = 4  # islands, and sync DP's data-parallel workers
BATCH = 2  # sequences per inner step per island (x 128 tokens): sync DP's global batch is PEERS x BATCH
STEPS = 4800  # inner steps per island: 30 outer steps at H = 160, 480 at H = 10; every H on the curve divides it
WARMUP = 100  # inner steps of linear lr warm-up, shared by both methods
FINAL_LR_FRACTION = 0.1  # the cosine decay ends at this fraction of the peak lr
FINAL_EVAL_BATCHES = 16  # batches of 16 held-out sequences for the final loss (262,144 tokens)
CURVE_POINTS = 24  # evaluations on the way (at the outer step nearest to each 1/24 of the run)
D_MODEL = ModelConfig().d_model
CLIP = InnerConfig().grad_clip_norm  # the peer's gradient clipping: the global norm clipped to this
SCHEDULES = ("fixed", "grow")


@dataclass(frozen=True)
class Run:
    """One training run of the study: sync DP, or DiLoCo at one H, codec and outer optimizer."""

    method: str  # "syncdp" or "diloco"
    inner_lr: float
    seed: int = 0
    inner_steps: int = 1  # H (sync DP: 1, it communicates every step)
    compression: str = "none"  # sync DP: fp32 gradients
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    steps: int = STEPS
    peers: int = PEERS
    batch_size: int = BATCH
    eval_batches: int = FINAL_EVAL_BATCHES
    schedule: str = "fixed"  # "grow": the same number of rounds, H rising from H/2 to 3H/2 (round_ends)
    reducer_feedback: bool = False  # the reducer's re-encode keeps its error for the next round (a stable group)
    data: str = "shards"  # "shards": each island a contiguous quarter of the corpus (as peers); "iid": all of it
    d_model: int = D_MODEL  # the built-in model's width (its layers, heads and context stay the default's)
    optimizer: str = "adamw"  # the inner optimizer (sync DP's only one): "adamw", or "muon" for the block matrices
    outer_warmup: int = 0  # outer updates over which the outer lr rises linearly (OuterConfig.warmup_steps)
    clip: float = CLIP  # the inner steps' gradient norm clip (InnerConfig.grad_clip_norm; 0: none)
    overlap: int = 0  # inner steps each island trains while its round's average is on the wire (OVERLAP_POINTS)
    eager: bool = False  # with overlap: those steps start from the outer step's preview with an estimated average

    def __post_init__(self) -> None:
        if self.optimizer not in INNER_OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(INNER_OPTIMIZERS)}, got {self.optimizer!r}")
        if self.data not in ("shards", "iid"):
            raise ValueError(f"data must be shards or iid, got {self.data!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.method not in ("syncdp", "diloco"):
            raise ValueError(f"method must be syncdp or diloco, got {self.method!r}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.clip < 0:
            raise ValueError(f"clip must be >= 0, got {self.clip}")
        if self.steps % self.inner_steps:
            raise ValueError(f"H = {self.inner_steps} does not divide the {self.steps} inner steps")
        if not 0 <= self.overlap <= (self.inner_steps if self.method == "diloco" else 0):
            raise ValueError(f"overlap must be between 0 and H (DiLoCo; 0 for sync DP), got {self.overlap}")
        if self.eager and not self.overlap:
            raise ValueError("eager needs an overlap: it changes where the steps taken meanwhile start")

    @property
    def key(self) -> str:
        size = "" if (self.peers, self.batch_size, self.steps) == (PEERS, BATCH, STEPS) else (
            f" peers={self.peers} batch={self.batch_size} steps={self.steps}")
        size += " data=iid" if self.data == "iid" else ""
        size += f" d={self.d_model}" if self.d_model != D_MODEL else ""
        size += f" {self.optimizer}" if self.optimizer != "adamw" else ""
        size += f" clip={self.clip:g}" if self.clip != CLIP else ""
        if self.method == "syncdp":
            return f"syncdp lr={self.inner_lr:g} seed={self.seed}{size}"
        schedule = "" if self.schedule == "fixed" else f" {self.schedule}"
        schedule += " reducer-feedback" if self.reducer_feedback else ""
        size += f" outer-warmup={self.outer_warmup}" if self.outer_warmup else ""
        size += f" overlap={self.overlap}" if self.overlap else ""
        size += " eager" if self.eager else ""
        return (f"diloco H={self.inner_steps}{schedule} {self.compression} lr={self.inner_lr:g} "
                f"outer={self.outer_lr:g}/{self.outer_momentum:g} seed={self.seed}{size}")

    def round_ends(self) -> list[int]:
        """The inner step at which each round ends. ``fixed``: every H steps. ``grow``: as many rounds (the same
        bytes), H rising linearly from about H/2 to 3H/2, so that more of the bytes go to the early rounds, where
        the islands drift apart fastest: round r of R ends at steps x x (1 + x) / 2, x = r / R."""
        rounds = self.steps // self.inner_steps
        if self.schedule == "fixed":
            return [self.inner_steps * (r + 1) for r in range(rounds)]
        return [round(self.steps * (r / rounds) * (1 + r / rounds) / 2) for r in range(1, rounds + 1)]

    @property
    def bytes_per_value(self) -> float:
        return 4.0 if self.method == "syncdp" else make_codec(self.compression).bytes_per_value()

    def wire_bytes_per_token(self, params: int, seq_len: int) -> float:
        """What one peer sends per token it trained (module docstring)."""
        sent_per_round = 2 * (self.peers - 1) / self.peers * params * self.bytes_per_value
        return sent_per_round / (self.inner_steps * self.batch_size * seq_len)

    @property
    def fewer_bytes_than_syncdp(self) -> float:
        return 4.0 * self.inner_steps / self.bytes_per_value


def lr_factor(step: int, steps: int, warmup: int = WARMUP, final: float = FINAL_LR_FRACTION) -> float:
    """The inner lr at ``step`` (0-based) as a fraction of the peak: the peer's schedule (core/schedule.py) with a
    linear warm-up over ``warmup`` steps and a cosine decay to ``final`` at the run's last step."""
    return schedule_factor(step, warmup, steps, final)


def _shards(run: Run) -> tuple[ModelConfig, list[Dataset], list]:
    torch.set_num_threads(1)
    config = ModelConfig(d_model=run.d_model)
    if run.data == "iid":  # every island samples windows of the whole training set, each in its own order
        shards = [Dataset(DataConfig(num_shards=1), config.seq_len, run.batch_size, run.seed + 104_729 * i)
                  for i in range(run.peers)]
    else:
        shards = [Dataset(DataConfig(num_shards=run.peers, shard_index=i), config.seq_len, run.batch_size, run.seed)
                  for i in range(run.peers)]
    held_out = Dataset(DataConfig(num_shards=run.peers, shard_index=0), config.seq_len, 16, 0).eval_batches(run.eval_batches)
    return config, shards, held_out


def _evaluate(model: torch.nn.Module, batches: list) -> float:
    model.eval()
    with torch.no_grad():
        return sum(model(x, y).item() for x, y in batches) / len(batches)


def _inner_optimizer(model: torch.nn.Module, run: Run) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The inner optimizer, as a peer builds it (train/inner_optimizer.py: AdamW, or Muon on the blocks' matrices and
    AdamW on the rest), and its lr schedule."""
    optimizer = build_inner_optimizer(run.optimizer, model, run.inner_lr, InnerConfig().weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, run.steps))


def _step(model: torch.nn.Module, optimizer, schedule, inputs, targets, grads: list | None = None, clip: float = CLIP) -> None:
    """One inner step, its gradient's norm clipped to ``clip`` (0: not clipped); ``grads``, when given, gets a copy of
    the step's gradients before clipping (_FloorProbe)."""
    model.train()
    loss = model(inputs, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grads is not None:
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
    if clip:
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
    optimizer.step()
    schedule.step()


def _curve_every(run: Run) -> int:
    """Rounds between evaluations on the way: about CURVE_POINTS of them in all."""
    return max(1, run.steps // run.inner_steps // CURVE_POINTS)


class _FloorProbe:
    """What the mean of the islands' steps is against the step sync DP would take from the same params on the same
    batches (phase floor's mechanism, docs/learning.md "The gap's floor"). At H = 1 every island steps from the global
    params, so the mean of their gradients is sync DP's gradient there (the shards' batches are equal in size); a
    shadow copy of the model with its own inner optimizer at sync DP's lr takes that gradient each step, and its step
    is compared with the islands' averaged one. The shadow never touches the run: the trajectory, and so the final
    loss, are the run's own. Per step: the mean step's length against the shadow's, its part along the shadow's step
    and across it (both as fractions of the shadow's length), their cosine, one island's step (RMS) against the
    shadow's, how often the gradient clipping acts on an island and on the shadow; at each quarter's end, AdamW's
    divisor (the square root of its second moment, where the optimizer keeps one) of an island against the shadow's,
    coordinate by coordinate (the median)."""

    def __init__(self, run: Run, config: ModelConfig, shadow_lr: float, optimizers: list[tuple]):
        if (run.method, run.inner_steps, run.compression, run.outer_lr, run.outer_momentum, run.schedule) != (
                "diloco", 1, "none", 1.0, 0.0, "fixed"):
            raise ValueError("the floor's probe needs DiLoCo at H = 1, fp32 (none) and plain averaging (outer 1 / 0)")
        if run.steps < 4:
            raise ValueError(f"the floor's probe reports quarters of the steps: it needs at least 4, got {run.steps}")
        self.shadow = build_model(config, run.seed)
        self.optimizer, self.schedule = _inner_optimizer(self.shadow, replace(run, inner_lr=shadow_lr))
        self.island_optimizers = [optimizer for optimizer, _ in optimizers]
        self.clip = run.clip  # the shadow clipped as the run's islands are (sync DP at the same setting)
        self.quarter_ends = {len(run.round_ends()) * q // 4 for q in range(1, 5)}
        self.grads: list[list[torch.Tensor]] = []  # the islands' gradients of this step, before clipping
        self.rows: list[dict] = []
        self.divisors: list[float] = []

    @torch.no_grad()
    def observe(self, global_params: list[torch.Tensor], average: list[torch.Tensor], sent: list[list[torch.Tensor]]) -> None:
        """After the islands' step (``sent``: each one's outer gradient, params minus island; ``average``: their
        mean, which the plain outer step subtracts from ``global_params``), before the outer step."""
        island_norms = [float(torch.cat([g.reshape(-1) for g in grads]).norm()) for grads in self.grads]
        for param, value, *grads in zip(self.shadow.parameters(), global_params, *self.grads):
            param.copy_(value)
            param.grad = torch.stack(grads).mean(0)
        self.grads.clear()
        shadow_norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.shadow.parameters()]))
        if self.clip:
            torch.nn.utils.clip_grad_norm_(list(self.shadow.parameters()), self.clip)
        self.optimizer.step()
        self.schedule.step()
        shadow = [p - v for p, v in zip(self.shadow.parameters(), global_params)]
        length2 = sum(float(d.pow(2).sum()) for d in shadow)
        mean2 = sum(float(a.pow(2).sum()) for a in average)
        along = -sum(float((a * d).sum()) for a, d in zip(average, shadow))  # the mean step is -average
        islands2 = sum(float(v.pow(2).sum()) for values in sent for v in values) / len(sent)
        across2 = sum(float((a + along / length2 * d).pow(2).sum()) for a, d in zip(average, shadow))  # -a minus its part along
        self.rows.append(dict(length=(mean2 / length2) ** 0.5, along=along / length2, across=(across2 / length2) ** 0.5,
                              cosine=along / (mean2 * length2) ** 0.5, island_length=(islands2 / length2) ** 0.5,
                              island_clipped=sum(0 < self.clip < n for n in island_norms) / len(island_norms),
                              shadow_clipped=float(0 < self.clip < shadow_norm)))
        if len(self.rows) in self.quarter_ends:
            self.divisors.append(self._divisor())

    def _divisor(self) -> float | None:
        """The median over the coordinates (those with a second moment, the AdamW ones) of an island's AdamW divisor
        against the shadow's, sqrt(v_island / v_shadow), averaged over the islands; None without a second moment."""
        def second_moments(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
            found = [s["exp_avg_sq"].reshape(-1) for s in optimizer.state.values() if "exp_avg_sq" in s]
            return torch.cat(found) if found else None

        shadow = second_moments(self.optimizer)
        if shadow is None:
            return None
        kept = shadow > 0
        ratios = [float((second_moments(o)[kept] / shadow[kept]).sqrt().median()) for o in self.island_optimizers]
        return sum(ratios) / len(ratios)

    def summary(self) -> dict:
        quarters = [self.rows[len(self.rows) * q // 4: len(self.rows) * (q + 1) // 4] for q in range(4)]
        return dict(quarters=[{k: round(sum(r[k] for r in rows) / len(rows), 4) for k in rows[0]}
                              | dict(divisor=None if divisor is None else round(divisor, 4))
                              for rows, divisor in zip(quarters, self.divisors)])


@torch.no_grad()
def preview(outer: OuterOptimizer, outer_grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The global params ``outer.step(outer_grads)`` would leave, as new tensors, with its arithmetic (core/outer.py);
    the params, the momentum and the step count stay as they are (phase overlap's eager runs)."""
    lr = fp32(outer.current_lr)
    previews = []
    for param, buffer, grad in zip(outer.params, outer.momentum_buffers, outer_grads, strict=True):
        update = grad.to(param.device, torch.float32)
        if outer.momentum:
            update = buffer.mul(outer._momentum).add_(update).mul_(outer._momentum).add_(update)  # g + mu (mu m + g)
        previews.append(param.sub(update.mul(lr)))
    return previews


def train(run: Run, shadow_lr: float | None = None) -> dict:
    """One run from the seeded init to the end of its budget; its final held-out loss and the curve on the way. With
    ``shadow_lr`` (a floor run only), the same run with _FloorProbe's measurement beside it, sync DP's step at that lr."""
    if shadow_lr is not None and run.method != "diloco":
        raise ValueError("the floor's probe measures DiLoCo runs")
    started = time.monotonic()
    config, shards, held_out = _shards(run)
    probe = None
    tokens_per_step = run.peers * run.batch_size * config.seq_len  # swarm tokens per inner step (all islands)
    global_model = build_model(config, run.seed)
    params = sum(p.numel() for p in global_model.parameters())
    curve = [(0, _evaluate(global_model, held_out[:4]))]
    cosines: list[float] = []
    agreements: list[float] = []
    if run.method == "syncdp":
        optimizer, schedule = _inner_optimizer(global_model, run)
        for step in range(run.steps):
            batches = [shard.train.next_batch() for shard in shards]
            _step(global_model, optimizer, schedule, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]),
                  clip=run.clip)
            if (step + 1) % _curve_every(run) == 0:
                curve.append(((step + 1) * tokens_per_step, _evaluate(global_model, held_out[:4])))
    else:
        islands = [build_model(config, run.seed) for _ in range(run.peers)]
        optimizers = [_inner_optimizer(island, run) for island in islands]
        global_params = [p.data for p in global_model.parameters()]
        outer = OuterOptimizer(global_params, OuterConfig(lr=run.outer_lr, momentum=run.outer_momentum,
                                                              warmup_steps=run.outer_warmup))
        codec = make_codec(run.compression)
        feedback = [ErrorFeedback(codec) for _ in islands] if run.compression in FEEDBACK_CODECS else None
        reducer = ErrorFeedback(codec) if run.reducer_feedback else None
        probe = None if shadow_lr is None else _FloorProbe(run, config, shadow_lr, optimizers)

        ends, previous, last_average = run.round_ends(), None, None
        trained = [0] * run.peers  # inner steps each island has taken (with overlap, some of the next round's too)
        for round_index, end in enumerate(ends):
            sent, snapshots, raw = [], [], []
            for i, (island, (optimizer, schedule), shard) in enumerate(zip(islands, optimizers, shards)):
                for _ in range(end - trained[i]):
                    _step(island, optimizer, schedule, *shard.train.next_batch(), grads=None if probe is None else probe.grads,
                          clip=run.clip)
                trained[i] = end
                if run.overlap:
                    snapshots.append([p.detach().clone() for p in island.parameters()])
                outer_grad = [g - p.detach() for g, p in zip(global_params, island.parameters())]
                raw.append(outer_grad)
                if feedback:
                    values, residual = feedback[i].prepare(outer_grad)
                    feedback[i].commit(residual)
                    sent.append(values)
                else:
                    sent.append(codec_round_trip(codec, outer_grad))
            average = [torch.stack(parts).mean(0) for parts in zip(*sent)]
            # how alike the islands' outer gradients are: |mean|^2 / mean |g_i|^2, 1 when all send the same, 1/n when
            # they are orthogonal (the averaged step's length against one island's)
            agreements.append(sum(float(a.pow(2).sum()) for a in average)
                              / (sum(float(v.pow(2).sum()) for values in sent for v in values) / len(sent)))
            if probe is not None:
                probe.observe(global_params, average, sent)
            if reducer is not None:  # the reducer's re-encode, its error sent in the next round
                average, residual = reducer.prepare(average)
                reducer.commit(residual)
            else:  # the reducer's re-encode, as a peer makes it
                average = codec_round_trip(codec, average)
            flat = torch.cat([a.reshape(-1) for a in average])
            if previous is not None:  # how alike consecutive outer gradients are: momentum's gain depends on it
                cosines.append(float(torch.nn.functional.cosine_similarity(flat, previous, dim=0)))
            previous = flat
            if run.overlap and round_index + 1 < len(ends):  # the next round's first steps, before the average lands
                for i, (island, (optimizer, schedule), shard) in enumerate(zip(islands, optimizers, shards)):
                    if run.eager:  # from where the outer step would go with the island's own outer gradient as 1/n of
                        # the average and the last round's average (the first round: its own again) for the rest
                        others = raw[i] if last_average is None else last_average
                        estimate = [g / run.peers + o * (1 - 1 / run.peers) for g, o in zip(raw[i], others)]
                        snapshots[i] = preview(outer, estimate)
                        with torch.no_grad():
                            for param, value in zip(island.parameters(), snapshots[i]):
                                param.copy_(value)
                    for _ in range(min(run.overlap, ends[round_index + 1] - end)):
                        _step(island, optimizer, schedule, *shard.train.next_batch(), clip=run.clip)
                        trained[i] += 1
            last_average = average
            outer.step(average)
            for i, island in enumerate(islands):
                with torch.no_grad():
                    if run.overlap:  # as a peer: local <- global + (local - where the steps meanwhile started)
                        for param, value, start in zip(island.parameters(), global_params, snapshots[i]):
                            param.copy_(value + (param - start))
                    else:
                        for param, value in zip(island.parameters(), global_params):
                            param.copy_(value)
            if (round_index + 1) % _curve_every(run) == 0:
                curve.append((end * tokens_per_step, _evaluate(global_model, held_out[:4])))
    final = _evaluate(global_model, held_out)
    diagnostics = {}
    if run.method == "diloco" and cosines:
        quarter = max(1, len(cosines) // 4)
        diagnostics = dict(outer_grad_cosine_first_quarter=round(sum(cosines[:quarter]) / quarter, 4),
                           outer_grad_cosine_last_quarter=round(sum(cosines[-quarter:]) / quarter, 4))
        quarter = max(1, len(agreements) // 4)
        diagnostics.update(island_agreement_first_quarter=round(sum(agreements[:quarter]) / quarter, 4),
                           island_agreement_last_quarter=round(sum(agreements[-quarter:]) / quarter, 4))
    if probe is not None:
        diagnostics.update(shadow_lr=shadow_lr, floor_probe=probe.summary())
    return dict(
        asdict(run), **diagnostics, key=run.key, final_loss=round(final, 5), tokens=run.steps * tokens_per_step,
        outer_steps=run.steps // run.inner_steps if run.method == "diloco" else 0,
        wire_bytes_per_token=round(run.wire_bytes_per_token(params, config.seq_len), 3),
        fewer_bytes_than_syncdp=round(run.fewer_bytes_than_syncdp, 1),
        curve=[(t, round(loss, 4)) for t, loss in curve], seconds=round(time.monotonic() - started, 1),
        torch=torch.__version__,
    )
