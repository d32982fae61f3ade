"""Speculative decoding: several tokens per step for one forward pass of the target.

Drafts come from prompt lookup or from a draft model. Prompt lookup: a decoding request whose last
``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) occurred earlier in its
prompt + output proposes the ``k`` tokens that followed that occurrence (``proposer.py``). A draft
model of the same tokenizer proposes its greedy continuation, run over the target's block tables
once the step's blocks exist (``draft_model.py``). ``k`` comes from the running batch's bucket in
``config.by_batch`` (the build's measured table), shortened for a request whose drafts are rarely
accepted. The scheduler gives its row ``1 + k`` tokens: the last committed token and the drafts,
computed like a prefill chunk over the cached context, with logits at every position (``verify_rows.py``). Each position is sampled as if the drafts before it were output (penalties,
min_tokens and logprobs see them), and the longest prefix of drafts equal to the sampled targets
is committed, plus the target at the first mismatch (or after the last draft). For a point-mass
draft this *is* rejection sampling: the target ``y ~ p`` equals the draft with probability
``p(draft)``, and a ``y`` that differs is a draw from ``p`` with the draft removed, renormalized
(``verify.py``). Greedy output is therefore the non-speculative output, token for token, and a
seeded request's generator is rewound to one draw per committed token, so seeded sampling gives
the same tokens as without speculation too.

The drafts' K/V is written into the request's blocks; rejected positions are rolled back by the
counters (``num_computed_tokens`` counts only committed tokens) and the blocks past them are freed
(``BlockManager.trim``); prefix-cache hashing reads ``token_ids``, which holds committed tokens only.
"""
