"""Answer logic of the `math` environment, free of torch and Ray: the child process that
runs math-verify under a time limit imports only this module (and math-verify).
"""

from __future__ import annotations

import re
from typing import Any

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# A number as written in prose: thousands separators, decimals, a fraction "3/4" (read whole, not
# as its denominator), and a sign, ASCII or the Unicode minus (U+2212) that models also write,
# unless it follows a word or a number ("pages 10-12" ends in 12, not -12): a dropped sign or
# denominator scored "-3" and "3/4" right against a gold answer of 3 and 4. A comma separates
# thousands only before groups of three digits: "1,2,3" and "(3,4)" end in 3 and 4, not 123 and 34.
# Scientific notation "1e3", "2.5E-3" is one number too (it ended in its exponent, 3), written as
# LaTeX by `_clean_number` (math-verify reads "1e3" as a product with Euler's e). A power "2^{10}"
# is one number too (it ended in its exponent, 10), as `_prose_numbers` writes it.
_NUMBER = re.compile(r"(?:(?<![\w.)\]}])[-\u2212])?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
                     r"(?:[eE][-+\u2212]?\d+(?!\w|\.\d)|/\d+|\^\{[-\u2212]?\d+\})?")

# Thousands written as LaTeX and typography do, "1{,}000", "1\,000", "1\ 000" and thin or no-break
# spaces, are separated by a comma ("$1{,}000$" ended in 000). A plain space is not: "1 000" is as
# often two numbers.
_GROUP_SEPARATOR = re.compile(r"(?<=\d)(?:\{,\}|\\[, ]|[\u2009\u202f\u00a0])(?=\d{3}(?!\d))")
# "2^10", "2^{10}": the exponent in braces, the form `_NUMBER` reads whole.
_POWER = re.compile(r"(?<=\d)\s*\^\s*(?:\{\s*([-\u2212]?\d+)\s*\}|(\d+))")
# A sign before a currency sign, "-$5", "-\$5", is the number's ("lost -$5" read as 5).
_SIGNED_CURRENCY = re.compile(r"(?<![\w.)\]}])([-\u2212])\s*\\?\$\s*(?=\.?\d)")

# An unboxed LaTeX fraction of integers, read as the "a/b" it is ("$\frac{3}{4}$" ended in 4), with
# the sign before it by `_NUMBER`'s rule ("-\frac{3}{4}" read as 3/4 scored a wrong sign right) and
# LaTeX's one-digit arguments without braces ("\frac34" was 34).
_LATEX_FRACTION = re.compile(r"(?:(?<![\w.)\]}])([-\u2212])\s*)?\\[dt]?frac\s*"
                             r"(?:\{\s*([-\u2212]?\d+)\s*\}|(\d))\s*(?:\{\s*(\d+)\s*\}|(\d))")


def _as_slash_fraction(m: re.Match) -> str:
    sign, numerator, denominator = m[1] or "", m[2] or m[3], m[4] or m[5]
    return f" {sign}{numerator}/{denominator}"


def _prose_numbers(text: str) -> list[str]:
    """The numbers of `text` as `_NUMBER` reads them, after LaTeX fractions, powers, grouped
    thousands and signed amounts of money are written in the forms it reads whole."""
    text = _LATEX_FRACTION.sub(_as_slash_fraction, _GROUP_SEPARATOR.sub(",", text))
    text = _SIGNED_CURRENCY.sub(r" \1", _POWER.sub(lambda m: f"^{{{m[1] or m[2]}}}", text))
    return _NUMBER.findall(text)


# A \boxed argument without braces: the word after the command, less the sentence's punctuation.
_BARE_ARGUMENT = re.compile(r"[^\s$]*[^\s$.,;:!?]")


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (nested braces matched), or the word after
    a \\boxed without braces ("\\boxed 5$" gives "5"); None if there is none."""
    start, cmd = max((text.rfind(cmd), cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    # The argument follows the command: a brace searched for further on ("\boxed 5, so
    # $\frac{1}{2}$") read a later expression's "1" as the answer.
    rest = text[start + len(cmd):]
    after = rest.lstrip()
    if not after.startswith("{"):
        if rest[:1].isalpha():  # another command ("\boxedsymbol"), not a box
            return None
        word = _BARE_ARGUMENT.match(after)
        return word[0] if word else None
    brace = len(text) - len(after)
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i].strip()
    return None


_SCIENTIFIC = re.compile(r"\s*[-\u2212]?(?:\d+(?:\.\d+)?|\.\d+)[eE][-+\u2212]?\d+\s*")


def _clean_number(s: str) -> str:
    s = s.replace(",", "").replace("\u2212", "-").rstrip(".")
    mantissa, e, exponent = s.lower().partition("e")
    # Scientific notation as LaTeX, which math-verify reads as the number: "2.5e-3" -> 2.5\times10^{-3}.
    # Written out, "1e99999999999" took all memory in the environment's own process, not the
    # verifier's child under its time limit, and 6.02e23 no longer equalled 6.02\times10^{23}.
    return f"{mantissa}\\times10^{{{int(exponent)}}}" if e else s


def extract_final_answer(text: str) -> str | None:
    """The boxed answer if any, else the last number of `text` (a fraction "3/4" is one), else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        boxed = _GROUP_SEPARATOR.sub(",", boxed)  # math-verify reads "1,000", not "1\,000"
        return _clean_number(boxed) if _SCIENTIFIC.fullmatch(boxed) else boxed
    numbers = _prose_numbers(text)
    return _clean_number(numbers[-1]) if numbers else None


def gold_answer(answer: Any) -> str:
    """The reference answer: the text after the last "####" (GSM8K), stripped, else the whole answer
    (a number in scientific notation as LaTeX and LaTeX's grouped thousands with commas, as the
    model's are)."""
    text = str(answer)
    if "####" in text:
        return _clean_number(text.rsplit("####", 1)[1].strip())
    text = _GROUP_SEPARATOR.sub(",", text.strip())
    return _clean_number(text) if _SCIENTIFIC.fullmatch(text) else text


def import_math_verify() -> None:
    """Warm-up of a new child: import math-verify once, and silence its warning that its own
    timeouts are off (expected: the parent enforces the limit)."""
    import logging

    import math_verify  # noqa: F401

    logging.getLogger("math_verify").setLevel(logging.ERROR)


def math_verify_equal(gold: str, pred: str, float_rounding: int) -> bool:
    """math-verify equivalence of two answers (runs in the child process; its own SIGALRM
    timeouts are off because the parent enforces the limit by killing the child)."""
    from math_verify import parse, verify

    return bool(
        verify(
            parse(f"${gold}$", parsing_timeout=None),
            parse(f"${pred}$", parsing_timeout=None),
            float_rounding=float_rounding,
            timeout_seconds=None,
        )
    )
