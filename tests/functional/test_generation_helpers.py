"""Shared helpers of the generation tests (no tests here): a tiny model with varied output,
prompt batches, and the train-side logprobs of generated sequences by a plain forward."""

from __future__ import annotations

import pytest
import torch

from posttrain.data.batch import BatchedDataDict

@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a busy machine every op of a
    2-thread pool waits for the other thread to be scheduled (a 2x64 matmul took 5 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


PROMPTS = ["hello", "1+2=", "The cat sat on", "x", "abc def ghi jkl mno", "Q: what is 7*8? A:"]


def perturbed_tiny(model_path: str, std: float = 0.3, seed: int = 1, dtype=torch.float32):
    """embedded:tiny with its matrices redrawn at `std`: a random init of 0.02 only ever
    repeats the last character, which would make the greedy and stop-string tests vacuous."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    perturb_(model, std, seed)
    return model.to(dtype).eval(), AutoTokenizer.from_pretrained(model_path)


def vllm_ready_model(folder) -> tuple:
    """embedded:small perturbed (std 0.2) and saved with its tokenizer to `folder`: the vLLM
    tests' model (vLLM's CPU attention needs head_dim in {32, 64, 80, ...}; tiny has 16).
    Returns (model, tokenizer, folder)."""
    from posttrain.embedded import resolve_model_path

    model, tok = perturbed_tiny(resolve_model_path("embedded:small"), std=0.2)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model, tok, folder


@torch.no_grad()
def perturb_(model, std: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * std)


def make_batch(tokenizer, texts=PROMPTS, repeat: int = 1) -> BatchedDataDict:
    enc = [tokenizer.encode(t, add_special_tokens=False) for t in texts] * repeat
    ids = torch.full((len(enc), max(map(len, enc))), tokenizer.pad_token_id, dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(e) for e in enc]))


@torch.no_grad()
def forward_logprobs(model, out: BatchedDataDict) -> torch.Tensor:
    """Token-aligned logprobs `[B, S']` of `out["output_ids"]` by one plain forward (position 0 is 0)."""
    ids = out["output_ids"]
    lengths = out["unpadded_sequence_lengths"]
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(ids.shape[0], 1), lp], dim=1)


def generated_mask(batch_in: BatchedDataDict, out: BatchedDataDict) -> torch.Tensor:
    """Bool `[B, S']`: positions holding generated tokens."""
    pos = torch.arange(out["output_ids"].shape[1])[None]
    start = out["unpadded_sequence_lengths"] - out["generation_lengths"]
    return (pos >= start[:, None]) & (pos < out["unpadded_sequence_lengths"][:, None])


def token_mult_prob_error(batch_in, out, train_lp: torch.Tensor) -> float:
    """mean over generated tokens of exp(|gen_logprob - train_logprob|) (1.0 = identical)."""
    m = generated_mask(batch_in, out)
    return float(torch.exp((out["logprobs"] - train_lp).abs()[m]).mean())
