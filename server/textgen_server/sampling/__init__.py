"""Sampling: from a step's logits to each row's next token, and when a request stops.

Modules:

- `chooser.py`: `HeterogeneousNextTokenChooser`, the batch's token choice with one set of parameters per row
  (`validate_parameters` checks them when a request arrives); `choose`, a step of either engine (the choice as
  host lists, `Chosen`, with each row's top-n tokens from `batch_top_tokens`).
- `watermark.py`: the green-list bias of watermarked rows (WATERMARK_GAMMA, WATERMARK_DELTA).
- `logits_process.py`: the penalties (repetition, frequency) and the warpers (temperature, top-k, top-p,
  typical-p), one class per parameter.
- `grammar.py`: llguidance matchers (JSON schema, regex): a constrained row's token mask, compiled per request.
- `greedy.py`: when an all-greedy batch's ids and logprobs come from the fused C++ op `textgen::greedy_pick`
  (layers/token_ops.cpp, built by layers/cpu_ops.py), and its call.
- `stopping.py`: a request's stopping criteria (length, EOS, stop sequences).

A step's order (TGI's): `choose` calls the chooser, which processes the logits of the rows that need it:
watermark -> repetition penalty -> frequency penalty (logits_process.py) -> grammar mask -> temperature -> top-k
-> top-p -> typical-p (logits_process.py); then each row takes its argmax (by greedy.py's op where it serves) or
draws from its seeded generator, its penalty history and grammar matcher record the chosen token, and `choose`
adds the top-n tokens. models/generations.py then detokenizes each token and checks the row's stopping criteria.
"""
