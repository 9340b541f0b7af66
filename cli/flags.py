"""The library's parameters as the `batchplan` command's options: one table, one rewrite.

The library names its parameters in backticks, as a Python caller writes them
(`` `max_tokens` ``, `` `oversize="drop"` ``, `` `epochs=3` ``); `to_cli_words` rewrites each
one found in `FLAGS` into the option a CLI user types (``--max-tokens``, ``--oversize drop``,
``--epochs 3``), so one message serves both. Anything else in backticks (a Python call, a
word the table does not hold) is left as written.
"""

from __future__ import annotations

import re

__all__ = ["FLAGS", "to_cli_words"]

# library parameter -> the CLI's words for it
FLAGS = {
    "max_tokens": "--max-tokens",
    "mode": "--mode",
    "world_size": "--world-size",
    "epochs": "--epochs",
    "seed": "--seed",
    "micro_batches": "--micro-batches",
    "tokens_per_step": "--tokens-per-step",
    "oversize": "--oversize",
    "drop_empty": "--drop-empty",
    "drop_last": "--drop-last",
    "shuffle_window": "--shuffle-window",
    "batch_multiple": "--batch-multiple",
    "balance": "--balance",
    "balance_window": "--balance-window",
    "hidden_size": "--hidden-size",
    "attention_coefficient": "--attention-coefficient",
    "rampup_start": "--rampup START",
    "rampup_tokens": "--rampup TOKENS",
    "seqlen_warmup_min": "--seqlen-warmup MIN",
    "seqlen_warmup_tokens": "--seqlen-warmup TOKENS",
    "length_column": "--length-column",
    "tokens_column": "--tokens-column",
    "loss_tokens_column": "--loss-tokens-column",
    "layout": "--layout",
    "only_epochs": "--only-epochs",
    "from_step": "--from-step",
    "dataset": "--dataset",
    "mixture": "--mixture",
}

_QUOTES = "\"'"
# `name` or `name=value` (value optionally quoted); names are Python identifiers.
_REFERENCE = re.compile(r"`(?P<name>[a-z_][a-z0-9_]*)(?:=(?P<value>[^`]+))?`")


def to_cli_words(message: str) -> str:
    """``message`` with every parameter of `FLAGS` written as the CLI's option.

    `` `name` `` -> the flag; `` `name=value` `` -> the flag and the value (quotes dropped);
    `` `name=True` `` -> the flag alone (a switch such as ``--drop-last``).
    """

    def rewrite(match: re.Match) -> str:
        flag = FLAGS.get(match["name"])
        if flag is None:
            return match[0]
        value = match["value"]
        if value is None or value == "True":
            return flag
        return f"{flag} {value.strip(_QUOTES)}"

    return _REFERENCE.sub(rewrite, message)
