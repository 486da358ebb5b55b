"""Build a small random EAGLE-3 head with a peer's own code, save it in that peer's format, and record the peer's
own teacher-forced logits for two drafting steps; run with vLLM's venv python (speculators lives there):

    python engines/workers/eagle3_reference.py speculators|specforge OUT_DIR [FLAGS_JSON]

Writes OUT_DIR/head/ (the peer's checkpoint, saved by the peer's save_pretrained) and OUT_DIR/reference.safetensors
(`features` (1, T, 3 H_target), `input_ids` (1, T + 1), `logits0`, `logits1` (1, T, draft vocab)). Step 0 slot j
reads token input_ids[j] and the target's features at j; step 1 slot j reads input_ids[j + 1] and step 0's own
output at slot j, as each peer's training-time test runs it. SpecForge is imported from its wheel unpacked on
PYTHONPATH (its package pins sglang; its draft model file needs none of it). Imports no draftsmith.
"""

import json
import sys
from pathlib import Path

import torch

T, VOCAB, DRAFT_VOCAB, HIDDEN, HEADS, KV, HEAD_DIM, FFN = 12, 300, 96, 64, 4, 2, 16, 128


def randomize(model, seed: int) -> None:
    """Every float weight random and O(1) (norms around 1): the peers' inits leave heads near zero or NaN, where a
    wrong norm or residual would hardly show in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if name.endswith("norm.weight") or ".norm" in name or "norm." in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * 2)


def vocab_map(seed: int):
    """A pruned head over a random sorted subset of the vocabulary: d2t offsets all different from 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(VOCAB - 1, generator=g)[:DRAFT_VOCAB].sort().values + 1
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(DRAFT_VOCAB), t2d


def speculators_head(out: Path, flags: dict, features, input_ids):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                        num_key_value_heads=KV, head_dim=HEAD_DIM, num_hidden_layers=1, rms_norm_eps=1e-5,
                        max_position_embeddings=256, rope_theta=10000.0)
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, eagle_aux_hidden_state_layer_ids=[1, 3, 5],
        **flags, speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=2)],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config).eval()
    randomize(model, 1)
    d2t, t2d = vocab_map(2)
    model.load_vocab_mappings(t2d, d2t)
    model.save_pretrained(out / "head")
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach().clone()))
    with torch.no_grad():  # its training forward, teacher-forced: step s reads input_ids shifted by s
        model(hidden_states=features, input_ids=input_ids[:, :T], document_ids=torch.zeros(1, T, dtype=torch.long),
              ttt_steps=2)
    hook.remove()
    return logits[0], logits[1][:, : T - 1]  # its step 1 slot T-1 reads a pad token


def specforge_head(out: Path, flags: dict, features, input_ids):
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    target_hidden = features.shape[-1] // 3
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                         num_key_value_heads=KV, head_dim=HEAD_DIM, num_hidden_layers=1, rms_norm_eps=1e-5,
                         max_position_embeddings=256, rope_theta=10000.0, draft_vocab_size=DRAFT_VOCAB,
                         target_hidden_size=target_hidden, tie_word_embeddings=False,
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}, **flags)
    config.architectures = ["LlamaForCausalLMEagle3"]
    model = LlamaForCausalLMEagle3(config, attention_backend="sdpa").eval()
    randomize(model, 1)
    d2t, t2d = vocab_map(2)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    model.save_pretrained(out / "head")
    with torch.no_grad():  # the steps of its training loop (algorithms/eagle3/model.py), teacher-forced
        hidden = model.project_hidden_states(features)
        mask = model.prepare_decoder_attention_mask(attention_mask=torch.ones(1, T, dtype=torch.bool),
                                                    hidden_states=hidden, batch_size=1, seq_length=T,
                                                    past_key_values_length=0)
        cache, positions, logits = [[], []], torch.arange(T)[None], []
        for step in range(2):
            emb = model.embed_input_ids(input_ids[:, step:step + T]).to(hidden.dtype)
            hidden = model.backbone(input_embeds=emb, hidden_states=hidden, cache_hidden=cache, attention_mask=mask,
                                    position_ids=positions)
            logits.append(model.compute_logits(hidden))
    return logits[0], logits[1][:, : T - 1]


def main(kind: str, out: str, flags: str = "{}") -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    out = Path(out)
    target_hidden = HIDDEN if kind == "speculators" else 48  # speculators' fc reads 3 H (the draft's width)
    features = torch.randn(1, T, 3 * target_hidden) * 2
    input_ids = torch.randint(0, VOCAB, (1, T + 1))
    build = {"speculators": speculators_head, "specforge": specforge_head}[kind]
    logits0, logits1 = build(out, json.loads(flags), features, input_ids)
    save_file({"features": features.contiguous(), "input_ids": input_ids.contiguous(),
               "logits0": logits0.contiguous(), "logits1": logits1.contiguous()}, str(out / "reference.safetensors"))
    print(json.dumps({"logits0": list(logits0.shape), "logits1": list(logits1.shape)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
