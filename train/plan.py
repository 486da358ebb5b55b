"""The plan before a large run: the draft's shape and what each GPU holds under each strategy, from the target's
config alone (no weights are read, nothing is allocated: the models are built on the meta device).

    python train/draft.py recipe=paper_ratio_70b plan=true trainer.devices=8
    python train/draft.py recipe=shallow_wide target.name=DIR_WITH_CONFIG_JSON plan=true trainer.devices=8

P is the draft's parameters, N the ranks, T = batch x (block - 1) the tokens the draft predicts per micro-batch, V
its logits' columns, h its width, q = heads x head_dim, k = KV heads x head_dim, i its MLP width. Each row is what
is held at the step's peak: Lightning frees the previous step's gradients only between a step's forward and its
backward (its closure zero-grads there), so the loss' forward holds every row at once. The total is their sum; it
exceeds the peak by at most the gradients row (a compiled loss peaks in its backward, when the old gradients are
gone and the new ones grow as activations are freed). `tests/test_plan.py` measures every row on a real Lightning
step of a tiny config.

Model states, bytes a parameter, under `bf16-mixed` (16-mixed alike; `32-true` in brackets where it differs):
- ddp: Lightning's mixed precision is autocast over fp32 weights: weights 4, gradients 4, AdamW's two moments 8,
  plus autocast's bf16 copies of every nn.Linear weight (2 x its parameters), held from the forward until the
  backward has passed them; DDP's reducer keeps its own buckets, another 4 (`gradient_as_bucket_view=False`, the
  default) with more than one rank.
- deepspeed_stage_2 / _3: DeepSpeed keeps the module in bf16 and an fp32 master copy in the optimizer. Its own
  estimators (`estimate_zero2_model_states_mem_needs`, `..._zero3_...`) count 2 P + 18 P / N for ZeRO-2 (bf16
  weights replicated; bf16 and fp32 gradient partitions 2 + 4, fp32 master 4 and moments 8 partitioned) and
  4 x the largest module's parameters + 18 P / N for ZeRO-3 (that module gathered in bf16, and its bf16 gradient,
  while it runs). The ZeRO paper's 2 P + 14 P / N for stage 2 leaves out the fp32 gradient partition DeepSpeed
  builds for the step. [32-true: 4-byte weights and gradients, no bf16 partition; the master copy stays.]
- fsdp: Lightning's FSDP keeps fp32 shards (weights, gradients, moments: 16 P / N) and gathers a unit's weights in
  bf16 (`MixedPrecision(param_dtype=bf16)`) for its forward and backward; the root unit (embeddings, final norm,
  head) stays gathered from the forward to the end of the backward (FSDP frees it only after backward), and at
  most two layer units are gathered at once (`limit_all_gathers`): weights 2 x (root + 2 layers). A unit's bf16
  gradient is whole until it is reduce-scattered: 2 x (root + 1 layer). Wrapped as one unit (no auto-wrap
  policy, the recipe before issue 44), all of P is gathered: 2 P for the weights and 2 P for the gradients.

Activations: what the draft's decoder layers keep for the backward, per token and layer, counted from what an HF
Llama-family layer saves under SDPA (flash or memory-efficient attention never materialises the s x s scores: it
keeps q, k, v, the output and one log-sum-exp per head and token). In 16-bit compute (bf16 module: DeepSpeed, FSDP)
16 h + 4 q + 4 k + 8 i + 4 heads + 8 bytes: each RMSNorm keeps its input in fp32 (4 h), the normalised input (2 h)
and its output (2 h); attention keeps the rotated q (2 q), k and v (2 x 2 k) and its output before o_proj
(2 q); the SwiGLU MLP keeps gate, up, silu(gate) and their product (4 x 2 i); each norm one fp32 rsqrt a token.
Under autocast over fp32 weights (ddp) the residual stream is fp32 and each projection casts the norm's output
anew (three casts before q, k, v, two before gate, up): 26 h instead of 16 h. In fp32 all of it is 4 bytes:
24 h + 8 q + 8 k + 16 i + 4 heads + 8. Plus the final norm with the head's input, 8 h, 10 h and 12 h bytes a
token in the three, and the rotary tables once. Korthikanti et al. 2022's 34 s b h + 5 a s^2 b is for Megatron's
GELU layers with the attention scores materialised; an HF Llama layer under SDPA keeps no s^2 term but more than
34 h in its wider SwiGLU MLP.

Logits: per position, the draft's logits (2 bytes a column in 16-bit compute, 4 in fp32), the target's (a teacher
pass: 2, its bf16 output; kept logits: 4, the store's rows expanded in the draft's dtype and a copy of them) and what
the loss holds of size V; kept logits add their read from the store, 16 bytes a kept entry (fp16 value, int32 index,
their int64 and 16-bit copies).
Compiled (`loss.compile`, the recipes' default) the fused loss keeps only its inputs and the logits' gradient:
2 + teacher + 2. Eager, the divergences keep fp32 log-softmaxes and probabilities of both: six fp32 copies (24
bytes) at their peak, measured for tv + forward_kl. Cross-entropy alone (no teacher): 12 bytes, the fp32
log-softmax it keeps, its gradient, and the logits' gradient (with the 16-bit logits and their gradient in 16-bit
compute: 2 + 4 + 4 + 2).

The target: bf16 (2 bytes a parameter) on every rank that holds a replica (training runs the target: a teacher pass
per step); with `target.ranks=first` (training reads kept logits only) rank 0 holds it once, spread over its node's
GPUs (`target.device_map=auto`), and the other ranks none: the target column is then the share on each of node
0's GPUs. Its own pass (validation, sampling) runs when the draft's activations are not held and is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from draftsmith.sampling.errors import DraftsmithError

GIB = 1024**3
STRATEGIES = ("ddp", "deepspeed_stage_2", "deepspeed_stage_3", "fsdp")
ROWS = ("weights", "gradients", "optimizer", "activations", "logits", "target")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
# The device memory the totals are held against when no GPU is at hand and `plan_device_gib` is unset: the 80 GB
# H100 and A100, the GPUs large runs most often rent (CUDA reports a little less as usable).
DEFAULT_DEVICE_GIB = 80.0


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model, read from a copy built on the meta device."""

    params: int
    layers: int  # decoder layers (FSDP's units)
    layer_params: int  # the largest decoder layer's parameters
    linear_params: int  # parameters of its nn.Linear modules: what autocast copies to 16 bits for a pass
    largest_module: int  # the most parameters one module holds itself (DeepSpeed's ZeRO-3 "largest layer")
    layer_class: str | None  # the decoder layer's class, None when FSDP cannot wrap by layer


def model_shape(config) -> ModelShape:
    """The causal LM `config` describes, counted without allocating it (tied weights once)."""
    from transformers import AutoModelForCausalLM

    from draftsmith.train.strategy import layer_classes

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    classes = layer_classes(model)
    layers = [m for m in model.modules() if type(m) in classes]
    linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
                 for p in m.parameters(recurse=False))
    return ModelShape(params=sum(p.numel() for p in model.parameters()), layers=len(layers),
                      layer_params=max((sum(p.numel() for p in m.parameters()) for m in layers), default=0),
                      linear_params=linear,
                      largest_module=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
                      layer_class=type(layers[0]).__name__ if layers else None)


def meta_params(config) -> int:
    """Parameters of the causal LM `config` describes, counted without allocating it (tied weights once)."""
    return model_shape(config).params


@dataclass
class Plan:
    draft_layers: int
    draft_hidden: int
    draft_params: int
    target_params: int
    ranks: int
    batch: int
    block: int
    devices_per_node: int
    draft: ModelShape
    dims: dict  # h, q, k, i, heads, head_dim of the draft
    columns: int  # the draft's logit columns (its vocabulary, or its pruned head's tokens)
    precision: str = "bf16-mixed"
    compiled_loss: bool = True
    teacher: str = "replica"  # replica (a teacher pass per step) | kept (the teacher store) | none (no distillation)
    target_first: bool = False  # target.ranks=first: rank 0 holds the target spread over its node, the others none
    target_bytes: int = 2  # a target parameter in its dtype
    kept_topk: int = 0  # teacher=kept: the entries a position keeps (loss.teacher_topk)
    passes: int = 1  # the draft's passes a step keeps for the backward: a feature head's unrolled steps
    notes: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Positions the draft predicts per micro-batch: every one but a block's last (it has no label)."""
        return self.batch * (self.block - 1)

    def compute(self, strategy: str) -> str:
        """How the strategy computes: fp32, autocast (16-bit matmuls over fp32 weights) or half (a 16-bit module)."""
        if self.precision == "32-true":
            return "fp32"
        return "autocast" if strategy == "ddp" else "half"

    def activations(self, strategy: str) -> float:
        """Bytes the draft's layers and final norm keep for the backward (module docstring)."""
        d, kind = self.dims, self.compute(strategy)
        h, q, k, i, heads = d["h"], d["q"], d["k"], d["i"], d["heads"]
        per_layer = {"fp32": 24 * h + 8 * q + 8 * k + 16 * i,
                     "autocast": 26 * h + 4 * q + 4 * k + 8 * i,
                     "half": 16 * h + 4 * q + 4 * k + 8 * i}[kind] + 4 * heads + 8
        final_norm = {"fp32": 12, "autocast": 10, "half": 8}[kind] * h + 4
        rotary = 2 * (self.block - 1) * d["head_dim"] * (2 if kind == "half" else 4)
        return self.passes * (self.tokens * (self.draft_layers * per_layer + final_norm) + rotary)

    def logits(self, strategy: str) -> float:
        """Bytes of the logits-sized tensors at the loss' peak (module docstring)."""
        own = 4 if self.compute(strategy) == "fp32" else 2
        if self.teacher == "none":  # cross-entropy alone (module docstring)
            per = 12
        else:
            teacher = 4 if self.teacher == "kept" else self.target_bytes
            per = own + teacher + (own if self.compiled_loss else 24)
        read = 16 * self.kept_topk if self.teacher == "kept" else 0  # the top-k read from the store
        return float(self.passes * self.tokens * (self.columns * per + read))

    def target(self) -> float:
        if self.target_first:
            return self.target_bytes * self.target_params / self.devices_per_node
        return float(self.target_bytes * self.target_params)

    def per_rank(self, strategy: str) -> dict[str, float]:
        """Bytes one GPU holds, by part (ROWS)."""
        n, p, s = self.ranks, self.draft_params, self.draft
        half = self.precision != "32-true"
        hb = 2 if half else 4  # a weight or gradient as the strategy computes with it
        if strategy == "ddp":
            weights = 4 * p + (2 * s.linear_params if half else 0)
            grads = 4 * p + (4 * p if n > 1 else 0)
            moments = 8 * p
        elif strategy in ("deepspeed_stage_2", "deepspeed_stage_3"):
            fp32_grads = 4 if half else 0  # the gradient partition converted for the fp32 step
            if strategy == "deepspeed_stage_2":
                weights, grads = hb * p, (hb + fp32_grads) * p / n
            else:
                weights, grads = hb * p / n + hb * s.largest_module, (hb + fp32_grads) * p / n + hb * s.largest_module
            moments = 12 * p / n  # fp32 master (a copy even in fp32) and the two moments, partitioned
        elif strategy == "fsdp":
            if s.layer_class is not None:
                root = p - s.layers * s.layer_params
                gathered, whole_grads = root + 2 * s.layer_params, root + s.layer_params
            else:
                gathered = whole_grads = p
            weights = 4 * p / n + hb * gathered
            grads = 4 * p / n + hb * whole_grads
            moments = 8 * p / n
        else:
            raise DraftsmithError(f"unknown strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
        return {"weights": float(weights), "gradients": float(grads), "optimizer": float(moments),
                "activations": float(self.activations(strategy)), "logits": self.logits(strategy),
                "target": self.target()}

    def total(self, strategy: str) -> float:
        return sum(self.per_rank(strategy).values())


def plan(target_config, draft_config, ranks: int, batch: int, block: int, devices_per_node: int | None = None, *,
         precision: str = "bf16-mixed", compiled_loss: bool = True, teacher: str = "replica",
         target_first: bool = False, columns: int | None = None, target_bytes: int = 2, kept_topk: int = 0,
         passes: int = 1) -> Plan:
    if precision not in PRECISIONS:
        raise DraftsmithError(f"plan=true sizes trainer.precision {', '.join(PRECISIONS)} (or auto: bf16-mixed on a "
                              f"GPU), got {precision!r}")
    d = draft_config
    heads = d.num_attention_heads
    head_dim = getattr(d, "head_dim", None) or d.hidden_size // heads
    kv = getattr(d, "num_key_value_heads", None) or heads
    dims = {"h": d.hidden_size, "q": heads * head_dim, "k": kv * head_dim, "i": d.intermediate_size,
            "heads": heads, "head_dim": head_dim}
    shape = model_shape(d)
    return Plan(d.num_hidden_layers, d.hidden_size, shape.params, meta_params(target_config), ranks, batch, block,
                devices_per_node or ranks, shape, dims, columns or d.vocab_size, precision, compiled_loss, teacher,
                target_first, target_bytes, kept_topk, passes)


def print_plan(p: Plan, target_name: str, target_config, device_gib: float, device_source: str,
               trainer_strategy: str | None = None) -> None:
    tc, s = target_config, p.draft
    print(f"plan for {target_name}: target {tc.num_hidden_layers} layers, d {tc.hidden_size}, "
          f"{p.target_params / 1e9:.2f} B parameters ({p.target_bytes * p.target_params / GIB:.1f} GiB in "
          f"{'bf16' if p.target_bytes == 2 else 'fp32'})")
    wrap = (f"FSDP wraps each {s.layer_class} ({s.layer_params / 1e9:.3f} B parameters)" if s.layer_class
            else "FSDP keeps it one unit")
    print(f"draft: {p.draft_layers} layers, d {p.draft_hidden}, {p.draft_params / 1e9:.3f} B parameters "
          f"({p.draft_layers / tc.num_hidden_layers:.2f} of the depth, {p.draft_hidden / tc.hidden_size:.2f} of "
          f"the width); {wrap}")
    teacher = {"replica": "a teacher pass per step", "none": "no distillation",
               "kept": "the target's kept logits (teacher store)"}[p.teacher]
    where = (f"rank 0 holds the target spread over node 0's {p.devices_per_node} GPU(s), the other ranks none "
             "(target.ranks=first)" if p.target_first else "a target replica on every rank")
    print(f"{p.ranks} rank(s), {p.devices_per_node} GPU(s) a node, micro-batch {p.batch} x {p.block} tokens, "
          f"{p.precision}, {'compiled' if p.compiled_loss else 'eager'} loss on {teacher}; {where}")
    over = [st for st in STRATEGIES if p.total(st) > device_gib * GIB]
    if trainer_strategy in over:
        print(f"warning: {trainer_strategy} (the trainer's) needs {p.total(trainer_strategy) / GIB:.1f} GiB per GPU, "
              f"more than the {device_gib:g} GiB of the device ({device_source})")
    elif trainer_strategy is None and len(over) == len(STRATEGIES):
        print(f"warning: every strategy needs more than the {device_gib:g} GiB of the device ({device_source})")
    print(f"  {'GiB per GPU':<20}" + "".join(f"{r:>12}" for r in ROWS) + f"{'total':>9}  {device_gib:g} GiB")
    for st in STRATEGIES:
        row = p.per_rank(st)
        mark = ">" if st == trainer_strategy else " "
        print(f"{mark} {st:<20}" + "".join(f"{row[r] / GIB:>12.2f}" for r in ROWS)
              + f"{p.total(st) / GIB:>9.2f}  {'over' if st in over else 'fits'}")
    for note in p.notes:
        print(note)


# -- disk and hours: an estimate, from a stated model -----------------------------------------------------------------
# What a GPU is assumed to do where nothing on it was measured: its dense bf16 peak (NVIDIA's H100 SXM datasheet,
# 989 TFLOP/s; plan_peak_tflops=N for another GPU), the share of it training reaches (plan_mfu) and the share batched
# decoding reaches (plan_decode_mfu). Each figure the plan prints from them is labelled an estimate.
PEAK_TFLOPS = 989.0
TRAIN_MFU = 0.35
DECODE_MFU = 0.10
BYTES_PER_TEXT_TOKEN = 10  # a JSONL row holds each token twice: its text (~4 bytes) and its id in `ids` (~6)
SMALLER_GPUS = (40.0, 48.0)  # A100-40GB, L40S/A6000 (48 GB): the GPUs a user often has besides an 80 GB one


@dataclass(frozen=True)
class Costs:
    """What a recipe's budget costs: the corpus on disk, the steps, and the hours (an estimate) to sample and
    to train."""

    samples: int
    epochs: float
    steps: int
    corpus_bytes: float
    store_bytes: float
    decode_tokens_per_s_per_gpu: float
    sampling_gpus: int
    sampling_hours: float
    train_flops: float
    train_hours: float
    assumptions: str


def costs(p: Plan, *, samples: int, epochs: float, prompt_tokens: int, new_tokens: int, kept_topk: int,
          kept_features: int, sampling_gpus: int, teacher_pass: bool = False,
          peak_tflops: float = PEAK_TFLOPS, mfu: float = TRAIN_MFU, decode_mfu: float = DECODE_MFU) -> Costs:
    """The budget's disk and hours under the stated model: sampling decodes `new_tokens` per sample at
    `decode_mfu` x peak / (2 x target parameters) tokens/s per GPU on `sampling_gpus`; training costs 6 x the
    draft's parameters a token for each of its passes (a feature head's unrolled steps), plus 2 x the target's
    when a step runs the target (`teacher_pass`), at `mfu` x peak on each of the plan's ranks. A sample is one
    block of min(prompt + reply, block) tokens (a conversation fits its block)."""
    tokens = min(prompt_tokens + new_tokens, p.block)
    store = samples * (new_tokens * kept_topk * (2 + 4) + (prompt_tokens + new_tokens) * kept_features * 2)
    rate = decode_mfu * peak_tflops * 1e12 / (2 * p.target_params)
    flops = samples * epochs * tokens * (6 * p.draft_params * p.passes + (2 * p.target_params if teacher_pass else 0))
    steps = math.ceil(samples / (p.ranks * p.batch)) * math.ceil(epochs)
    return Costs(samples, epochs, steps, float(samples * tokens * BYTES_PER_TEXT_TOKEN), float(store), rate,
                 sampling_gpus, samples * new_tokens / (rate * sampling_gpus) / 3600, flops,
                 flops / (p.ranks * mfu * peak_tflops * 1e12) / 3600,
                 f"{peak_tflops:g} TFLOP/s bf16 peak a GPU (plan_peak_tflops), training at {mfu:g} of it "
                 f"(plan_mfu), decoding at {decode_mfu:g} (plan_decode_mfu)")


def print_costs(c: Costs, where: str) -> None:
    print(f"budget: {c.samples} samples x {c.epochs:g} epochs = {c.steps} steps (a sample a block)")
    print(f"disk: corpus {c.corpus_bytes / GIB:.1f} GiB + kept store {c.store_bytes / GIB:.1f} GiB, in {where}")
    print(f"estimate, not a measurement ({c.assumptions}): sampling {c.sampling_hours:.1f} h on {c.sampling_gpus} "
          f"GPU(s) at {c.decode_tokens_per_s_per_gpu:,.0f} tokens/s each; training {c.train_hours:.1f} h "
          f"({c.train_flops:.3g} FLOPs)")


def fits_smaller(p: Plan) -> str:
    """Which strategies fit the smaller GPUs users often have (40 and 48 GB)."""
    parts = []
    for gib in SMALLER_GPUS:
        ok = [st for st in STRATEGIES if p.total(st) <= gib * GIB]
        parts.append(f"{gib:g} GiB: {', '.join(ok) if ok else 'none'}")
    return "on smaller GPUs: " + "; ".join(parts)


def feature_head_config(target_config, draft_vocab: int | None):
    """A feature head's shape for the plan: one decoder layer of the target's width, its head over `draft_vocab`
    tokens (the embedding is the target's own, shared and frozen: not the draft's)."""
    import copy

    c = copy.deepcopy(target_config)
    c.num_hidden_layers = 1
    c.vocab_size = draft_vocab or target_config.vocab_size
    c.tie_word_embeddings = True  # one matrix of that size: the head
    return c


def plan_run(cfg) -> dict:
    from draftsmith.drafts.build import draft_config_for
    from draftsmith.sampling.names import config_of
    from draftsmith.train.draft_init import draft_config
    from draftsmith.train.losses import DIVERGENCES
    from draftsmith.train.prepare import vllm_samples
    from draftsmith.train.target import first_rank_only, ranks_setting, training_calls_target

    draft_cfg = draft_config(cfg)
    feature = draft_cfg.kind == "feature_head"
    target_config = config_of(cfg.target.name)  # config.json alone: no weights are fetched or read
    devices = cfg.trainer.get("devices", 1)
    devices = devices if isinstance(devices, int) else 1
    ranks = devices * int(cfg.trainer.get("num_nodes", 1) or 1)
    # the target's placement as training decides it (a target.ranks=first the run would refuse is refused here)
    loss, g = cfg.loss, cfg.data.generated
    topk = loss.get("teacher_topk", 0)
    distill = loss.get("distill", True) and any(loss.weights.get(n, 0) for n in DIVERGENCES)
    vllm_samples = vllm_samples(cfg)
    stored = feature and cfg.data.get("features", "stored") == "stored" and topk and not vllm_samples
    why = training_calls_target(cfg, feature, feature and not stored, topk or None, bool(g.enabled))
    first = first_rank_only(ranks_setting(cfg), why) and ranks > 1
    precision = str(cfg.trainer.get("precision", "auto"))  # auto: what a GPU with bf16 picks (sampling/precision.py)
    teacher = "none" if not distill else "kept" if topk else "replica"
    shape = feature_head_config(target_config, draft_cfg.draft_vocab) if feature else \
        draft_config_for(target_config, draft_cfg)
    p = plan(target_config, shape, ranks, cfg.data.batch_size,
             cfg.data.block_size, devices, precision="bf16-mixed" if precision == "auto" else precision,
             compiled_loss=bool(loss.get("compile", True)), teacher=teacher, target_first=first,
             columns=draft_cfg.draft_vocab, target_bytes=4 if str(cfg.target.dtype) == "fp32" else 2,
             kept_topk=int(topk or 0), passes=draft_cfg.unroll if feature else 1)
    if feature:
        p.notes.append("feature head: one decoder layer of the target's width and its pruned head, counted as "
                       "trainable (an upper bound: the head is frozen by default), plus fc's 3h x h not counted; the "
                       f"unrolled steps (draft.unroll={draft_cfg.unroll}) each keep their activations and logits")
    if cfg.get("plan_device_gib"):
        device_gib, source = float(cfg.plan_device_gib), "plan_device_gib"
    elif torch.cuda.is_available():
        device_gib = torch.cuda.get_device_properties(0).total_memory / GIB
        source = f"this machine's {torch.cuda.get_device_name(0)}; plan_device_gib=N for another"
    else:
        device_gib, source = DEFAULT_DEVICE_GIB, "an 80 GB H100 or A100; plan_device_gib=N for another GPU"
    print_plan(p, cfg.target.name, target_config, device_gib, source, strategy_name(cfg.trainer))
    print(fits_smaller(p))
    result = {"plan": {s: p.per_rank(s) for s in STRATEGIES}, "device_gib": device_gib}
    if g.enabled:  # the corpus' disk and the budget's hours: an estimate from the stated model (train/plan.py)
        keep = topk if loss.get("distill", True) else 0
        c = costs(p, samples=int(g.n_prompts) * int(g.samples_per_prompt),
                  epochs=float(cfg.trainer.get("max_epochs") or 1), prompt_tokens=int(cfg.data.prompt_tokens),
                  new_tokens=int(g.max_new_tokens), kept_topk=int(keep or 0),
                  kept_features=3 * target_config.hidden_size if stored else 0,
                  sampling_gpus=int(g.tensor_parallel_size) * int(g.data_parallel_size) if vllm_samples else 1,
                  teacher_pass=teacher == "replica" or (feature and not stored),
                  peak_tflops=float(cfg.plan_peak_tflops), mfu=float(cfg.plan_mfu),
                  decode_mfu=float(cfg.plan_decode_mfu))
        print_costs(c, cfg.data.get("cache_dir") or "$DRAFTSMITH_HOME (data.cache_dir)")
        result["costs"] = c.__dict__
    return result


def strategy_name(trainer) -> str | None:
    """The plan's name for the trainer's strategy; None for one it does not size."""
    from omegaconf import DictConfig

    st = trainer.get("strategy", "auto")
    if isinstance(st, (dict, DictConfig)):
        target = str(st.get("_target_", ""))
        if target.endswith("DeepSpeedStrategy"):
            return f"deepspeed_stage_{st.get('stage', 2)}"
        return "fsdp" if target.endswith("FSDPStrategy") else None
    st = str(st)
    if st in ("auto", "ddp", "ddp_spawn", "single_device") or st.startswith("ddp"):
        return "ddp"  # Lightning's auto picks DDP for several devices, one device alone for one (ddp's row at 1)
    return st if st in ("deepspeed_stage_2", "deepspeed_stage_3", "fsdp") else None
