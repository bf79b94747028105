"""Opacus as the same-run anchor for the worker's clipping engines (``benchmarks/worker.py``).

Opacus (Yousefpour et al., "Opacus: User-Friendly Differential Privacy Library in PyTorch")
computes Σ_i clip(∇ loss_i, C) over examples i, what its DPOptimizer adds noise to, on the same
model, tokens, loss and token-budget micro-batches as userdp's engines (per-example units only);
``worker.py`` times it in the same interleaved rounds. :class:`OpacusAnchor` drives two modes:

- ``opacus-hooks``: ``GradSampleModule`` puts each example's gradient in ``p.grad_sample``;
  DPOptimizer's own ``clip_and_accumulate`` clips and sums them in a skipped step (as Opacus'
  BatchMemoryManager does for physical batches);
- ``opacus-ghost``: ghost clipping (Li et al., "Large Language Models Can Be Strong
  Differentially Private Learners"): ``GradSampleModuleFastGradientClipping`` takes per-example
  norms in a first backward without per-example gradients, then a second backward of the
  clip-weighted loss Σ_i c_i·loss_i gives the sum.

GPT-2's ``Conv1D`` (a Linear whose weight is stored transposed) has no Opacus sampler:
:func:`register_conv1d_samplers` registers a grad sampler and Opacus' Linear norm sampler for it
through Opacus' registries. Opacus' ghost clipping refuses tied parameters (GPT-2's
``wte``/``lm_head``): :func:`tied_layers` finds them, and the ghost anchor gives their layer
types per-example gradients instead; each anchor row says how Opacus handled every layer type.

Before timing, :func:`check_agreement` compares the anchor's clipped sum with userdp's exact
engines (``loop``, ``vectorized``) at a clip norm that clips some examples and not others.
:data:`AGREEMENT_TOLERANCE` (relative L2 1e-4, fp32) sits above float32 summation-order and
norm error and below a missing layer or one example's wrong gradient. Without Opacus installed
(the ``bench`` extra) the anchor rows say skipped (:func:`opacus_missing`).
"""

from __future__ import annotations

OPACUS_MODES = ("opacus-hooks", "opacus-ghost")
AGREEMENT_TOLERANCE = {"fp32": 1e-4}
"""Largest relative L2 distance ‖a − r‖/‖r‖ between the anchor's and userdp's clipped sums
(flattened, all trainable parameters) that counts as agreement. float32 (ε ≈ 6e-8): the sums of
per-token products differ only in order and grouping (~1e-7; ``loop`` vs ``vectorized`` in the
same run is that floor), but the clip factors inherit the error of each side's norms: userdp adds
squares in float64, Opacus hooks takes each layer's per-example norm in float32 over up to
2.4M entries (GPT-2 small's MLP rows, the largest layer of these presets), which torch's CPU
reduction gets to ~4e-5 relative (hence ~2e-5 measured at GPT-2 small; ghost norms and the
1e-6 in Opacus' C/(‖g‖ + 1e-6) add less). 1e-4 is above that and below a real mistake: a
missing layer moves the sum by that layer's share of it, one of n examples with a wrong gradient
or norm by ~1/n (n ≤ 512 examples per token set here, so ≥ 2e-3). No tolerance is claimed for
bf16."""


def opacus_missing() -> str | None:
    """Why the Opacus anchor cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("opacus") is None:
        return "skipped: Opacus is not installed (the `bench` extra: pip install -e '.[bench]')"
    return None


def register_conv1d_samplers() -> None:
    """Opacus samplers for transformers' ``Conv1D`` (GPT-2's attention and MLP layers), through
    Opacus' registries. Conv1D computes x·W + b with W stored [in, out], a Linear with a
    transposed weight: its per-example weight gradient is Σ_t a_t g_tᵀ ([in, out], the layout of
    W), and its per-example norm is the Linear one, since ‖Σ_t a_t g_tᵀ‖_F = ‖Σ_t g_t a_tᵀ‖_F
    (so Opacus' own ``compute_linear_norm_sample`` is registered unchanged)."""
    import torch
    from opacus.grad_sample import register_grad_sampler, register_norm_sampler
    from opacus.grad_sample.linear import compute_linear_norm_sample
    from transformers.pytorch_utils import Conv1D

    @register_grad_sampler(Conv1D)
    def compute_conv1d_grad_sample(layer, activations, backprops):
        activations = activations[0].to(backprops.dtype)
        grads = {}
        if layer.weight.requires_grad:
            grads[layer.weight] = torch.einsum("n...i,n...j->nij", activations, backprops)
        if layer.bias is not None and layer.bias.requires_grad:
            grads[layer.bias] = torch.einsum("n...k->nk", backprops)
        return grads

    register_norm_sampler(Conv1D)(compute_linear_norm_sample)


class OpacusAnchor:
    """Σ_i clip(∇ loss_i, C) over examples i by Opacus on ``module``: what its DPOptimizer adds
    noise to. Same loss (:func:`userdp.clients.batching.token_losses` with the unit weights:
    one row = one example = one unit) and the same token-budget micro-batches as the engines.

    ``hooks``: ``GradSampleModule`` (grad_sample_mode "hooks") puts each example's gradient in
    ``p.grad_sample``; ``DPOptimizer.pre_step`` of a skipped step (``signal_skip_step``, as
    Opacus' BatchMemoryManager does for physical batches) clips them with the optimizer's own
    ``clip_and_accumulate`` into ``p.summed_grad``.
    ``ghost``: ``GradSampleModuleFastGradientClipping(use_ghost_clipping=True)`` and
    ``DPTensorFastGradientClipping.backward``: a first backward whose hooks compute per-example
    norms (ghost norms for layers with a norm sampler, per-example gradients for the others), a
    second backward of Σ_i c_i·loss_i into ``.grad``; ``DPOptimizerFastGradientClipping``'s
    skipped ``pre_step`` accumulates it into ``p.summed_grad``. Opacus' ghost clipping refuses
    tied parameters (GPT-2's ``wte``/``lm_head``): the layer types that hold one (Embedding,
    Linear) get per-example gradients instead (``layers`` says so).

    Noise is never added (noise_multiplier 0 and no unskipped step) and no parameter changes.
    The hooks are attached for each call and removed after it, as the engines do; the module is
    in train mode during a call (Opacus' hooks skip eval-mode layers; the presets have no
    dropout). ``max_examples`` > 0 caps the examples per backward (physical batches)."""

    def __init__(self, module, mode: str, token_budget: int, max_examples: int = 0) -> None:
        import warnings

        import torch
        from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

        # the embeddings' inputs are token ids (no gradient): Opacus' full backward hooks say so
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        register_conv1d_samplers()
        self.module, self.mode = module, mode
        self.token_budget, self.max_examples = token_budget, max_examples
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        sgd = torch.optim.SGD(list(self.params.values()), lr=0.0)
        options = {"noise_multiplier": 0.0, "max_grad_norm": 1.0, "expected_batch_size": None}
        tied: dict = {}
        if mode == "opacus-hooks":
            self.gsm = GradSampleModule(module, batch_first=True, loss_reduction="sum")
            self.optimizer = DPOptimizer(sgd, loss_reduction="sum", **options)
        else:
            self.gsm = GradSampleModuleFastGradientClipping(
                module, batch_first=True, loss_reduction="sum", use_ghost_clipping=True
            )
            tied = tied_layers(module)
            refused = {type(layer) for layer in tied.values()}
            self.gsm.NORM_SAMPLERS = {  # this instance only; the registry is unchanged
                kind: f for kind, f in type(self.gsm).NORM_SAMPLERS.items() if kind not in refused
            }
            self.optimizer = DPOptimizerFastGradientClipping(sgd, loss_reduction="sum", **options)
        self.layers = self._describe_layers(tied)
        self.gsm.remove_hooks()  # attached per call

    def _describe_layers(self, tied: dict) -> str:
        """How Opacus computes each trainable layer's per-example contribution, by layer type."""
        from collections import Counter

        ghost = self.mode == "opacus-ghost"
        kinds: Counter = Counter()
        for layer in self.gsm.iterate_submodules(self.module):
            kind = type(layer)
            if ghost and kind in self.gsm.NORM_SAMPLERS:
                how = "ghost norm"
            elif kind in self.gsm.GRAD_SAMPLERS:
                how = "per-example gradient"
            else:
                how = "per-example gradient by functorch"
            kinds[how, kind.__name__] += 1
        parts = []
        for how in ("ghost norm", "per-example gradient", "per-example gradient by functorch"):
            names = [f"{name}×{count}" for (h, name), count in sorted(kinds.items()) if h == how]
            if names:
                parts.append(f"{how}: {', '.join(names)}")
        text = "; ".join(parts)
        if tied:
            text += (
                f" (tied parameters shared by {', '.join(sorted(tied))}: Opacus ghost clipping "
                "refuses them, so their layer types take per-example gradients)"
            )
        if "Conv1D" in text:
            text += "; Conv1D samplers registered by this benchmark"
        return text

    def __call__(self, units, clip_norm: float = 1.0) -> dict:
        """Σ_i clip(∇ loss_i, ``clip_norm``) by parameter name (float tensors of the model's dtype)."""
        import functools

        import torch
        from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
        from userdp.clients.batching import make_batch, pack_units, prepare_units, token_losses

        prepared = prepare_units(units, None)
        batches, oversized = pack_units(prepared, self.token_budget)
        device = next(iter(self.params.values())).device
        self.optimizer.max_grad_norm = clip_norm
        self.gsm.max_grad_norm = clip_norm  # the ghost module clips with its own copy
        self.gsm.add_hooks(loss_reduction="sum", batch_first=True)
        self.module.train()
        try:
            for indices in batches + [[i] for i in oversized]:
                step = self.max_examples or len(indices)
                for start in range(0, len(indices), step):
                    batch = make_batch(prepared, indices[start : start + step], device, 0)
                    if len(batch.units) != batch.inputs.shape[0]:
                        raise ValueError("the Opacus anchor is per-example: a unit is one example")
                    rows, length = batch.inputs.shape
                    # explicit per-row positions: Opacus reads a layer's examples from dim 0, and
                    # the models' default position ids are one [1, length] row for the batch
                    positions = torch.arange(length, device=device).expand(rows, length)
                    forward = functools.partial(self.gsm, position_ids=positions)
                    losses = (token_losses(forward, batch) * batch.weights).sum(dim=1)
                    if self.mode == "opacus-ghost":
                        DPTensorFastGradientClipping(
                            self.gsm, self.optimizer, losses, "sum"
                        ).backward()
                    else:
                        losses.sum().backward()
                    self.optimizer.signal_skip_step(True)
                    self.optimizer.pre_step()  # clip and accumulate into p.summed_grad only
                    self.optimizer.zero_grad(set_to_none=True)
            sums = {name: p.summed_grad for name, p in self.params.items()}
        finally:
            for p in self.params.values():
                p.summed_grad = None
            self.gsm.remove_hooks()
            self.module.eval()
        missing = [name for name, value in sums.items() if value is None]
        if missing:
            raise ValueError(f"Opacus returned no clipped gradient for {missing[:3]}")
        return sums


def opacus_failure(exc: Exception) -> str:
    return f"Opacus failed: {type(exc).__name__}: {exc}"[:600]


def tied_layers(module) -> dict:
    """Layer name -> layer, for the layers that share a trainable parameter with another."""
    owners: dict[int, list] = {}
    for name, layer in module.named_modules():
        for param in layer.parameters(recurse=False):
            if param.requires_grad:
                owners.setdefault(id(param), []).append((name, layer))
    return {name: layer for shared in owners.values() if len(shared) > 1 for name, layer in shared}


def check_agreement(runner, runs: dict, units, dtype: str) -> dict:
    """The anchor's clipped sum vs userdp's exact engines (``loop``, ``vectorized``) on the same
    tokens, at a clip norm halfway between the smallest and largest example norm (from
    ``vectorized`` at C = 1), so that both branches of min(1, C/‖g‖) are exercised. Relative L2
    distances on the flattened sums (float64 arithmetic); ``ok`` against
    :data:`AGREEMENT_TOLERANCE` (None for a dtype without one)."""
    import torch

    references = {mode: runs.get(mode) or runner(mode) for mode in ("loop", "vectorized")}
    stats = references["vectorized"](units).stats
    clip_norm = (stats.norm_min + stats.norm_max) / 2 or 1.0

    def flat(sums) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).double().cpu() for t in sums.values()])

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    exact = {mode: run(units, clip_norm) for mode, run in references.items()}
    names = list(exact["loop"].sums)
    loop, vectorized = (flat(exact[m].sums) for m in ("loop", "vectorized"))
    tolerance = AGREEMENT_TOLERANCE.get(dtype)
    at_clip_norm = exact["loop"].stats
    out = {}
    for mode in (m for m in OPACUS_MODES if m in runs):
        try:
            sums = runs[mode](units, clip_norm)
        except Exception as exc:  # noqa: BLE001 - reported in the anchor's row
            out[mode] = {"error": opacus_failure(exc)}
            continue
        anchor = flat({name: sums[name] for name in names})
        versus = {"loop": distance(anchor, loop), "vectorized": distance(anchor, vectorized)}
        out[mode] = {
            "clip_norm": clip_norm,
            "examples_clipped": f"{at_clip_norm.clipped} of {at_clip_norm.count}",
            "example_norms": [stats.norm_min, stats.norm_max],
            "rel_l2_vs_loop": versus["loop"],
            "rel_l2_vs_vectorized": versus["vectorized"],
            "rel_l2_loop_vs_vectorized": distance(vectorized, loop),
            "tolerance": tolerance,
            "ok": None if tolerance is None else max(versus.values()) <= tolerance,
        }
    return out


def anchor_note(row: dict) -> str:
    """One markdown line on an Opacus row: its agreement with userdp and its layers, or why it
    did not run."""
    lora = f"LoRA r={row['lora_rank']}" if row["lora_rank"] else "full"
    head = f"- {row['preset']} {lora} {row['mode']}: "
    if row.get("note"):
        return head + row["note"]
    a = row["agreement"]
    verdict = {True: "agrees", False: "DISAGREES", None: "no tolerance for this dtype"}[a["ok"]]
    tolerance = "—" if a["tolerance"] is None else f"{a['tolerance']:.0e}"
    return head + (
        f"clipped sum vs userdp `loop` {a['rel_l2_vs_loop']:.1e}, `vectorized` "
        f"{a['rel_l2_vs_vectorized']:.1e} relative L2 (`loop` vs `vectorized` "
        f"{a['rel_l2_loop_vs_vectorized']:.1e}; tolerance {tolerance}) at C = "
        f"{a['clip_norm']:.3g}, {a['examples_clipped']} examples clipped: {verdict}. "
        f"Layers: {row['layers']}."
    )
