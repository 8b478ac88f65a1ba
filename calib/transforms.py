"""Requests calib must not judge: those whose target distribution a per-request logit transform changes.

calib's tables describe how often the target accepts a draft under plain sampling at some temperature.
A request with ``allowed_token_ids``, ``logit_bias``, ``bad_words``, a presence / frequency / repetition
penalty other than neutral, or structured output (a grammar) is verified against a *transformed* target
distribution that the drafter never sees: it accepts differently (vLLM's upstream online acceptance
estimator found the same poisoning). So:

* serving leaves such a request to vLLM: its drafts and its step's draft passes are vLLM's own
  (:meth:`calib.vllm.server.Server.step`);
* capture marks its rounds in the bank: speculator.parquet's optional ``logit_transforms`` column (the
  names below, comma-joined; ``""`` none; null not recorded — banks made before the column);
* training leaves those rounds out unless ``data.keep_logit_transforms=true``
  (:meth:`calib.bank.io.Bank` ``judged_only``).

:func:`target_only_transforms` reads a vLLM ``SamplingParams`` duck-typed (any object with those attributes).
"""

from __future__ import annotations

# name -> (attribute of vLLM's SamplingParams, the value that transforms nothing)
TRANSFORMS: dict[str, tuple[str, object]] = {
    "allowed_token_ids": ("allowed_token_ids", None),
    "logit_bias": ("logit_bias", None),
    "bad_words": ("bad_words", None),
    "presence_penalty": ("presence_penalty", 0.0),
    "frequency_penalty": ("frequency_penalty", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "structured_output": ("structured_outputs", None),
}
NAMES = tuple(TRANSFORMS)
COLUMN = "logit_transforms"  # speculator.parquet (calib.bank.schema.ROUND_COLUMNS)


def _neutral(value, neutral) -> bool:
    if value is None:
        return True
    if neutral is None:  # a collection: empty transforms nothing
        try:
            return len(value) == 0
        except TypeError:
            return False
    try:
        return float(value) == float(neutral)
    except (TypeError, ValueError):
        return False


def target_only_transforms(params) -> tuple[str, ...]:
    """The target-only logit transforms a request's sampling parameters apply (names of :data:`TRANSFORMS`,
    in that order); ``()`` for None or a plain request. A request with any of them is not calib's to judge."""
    if params is None:
        return ()
    found = []
    for name, (attr, neutral) in TRANSFORMS.items():
        value = getattr(params, attr, None)
        if name == "bad_words" and _neutral(value, None):  # vLLM may keep only the token ids
            value = getattr(params, "_bad_words_token_ids", None)
        if not _neutral(value, neutral):
            found.append(name)
    return tuple(found)


def encode(names) -> str:
    """The bank's ``logit_transforms`` value: names comma-joined, ``""`` for none."""
    return ",".join(names)


def decode(value) -> tuple[str, ...] | None:
    """The names a ``logit_transforms`` value lists; None where it was not recorded (null)."""
    if value is None:
        return None
    return tuple(n for n in str(value).split(",") if n)
