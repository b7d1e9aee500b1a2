"""Final-answer extraction and MATH-style normalisation (pure Python, no third-party imports).

Everything here is bounded: the only full-length passes over the model output are ``str.rfind``
(C speed); brace matching and regexes run on at most ``MAX_ANSWER_CHARS`` characters. Nothing
here parses or evaluates mathematics; that is :mod:`dsv3_rl.reward.verifier`'s job.

The normalisation follows the MATH benchmark's ``is_equiv`` (Hendrycks et al. 2021): drop
``\\left``/``\\right``, ``\\!``, ``^\\circ``, ``\\$``, ``\\%``, units and ``\\text{}``; ``dfrac``/``tfrac``
to ``frac``; ``\\frac12`` to ``\\frac{1}{2}``; ``\\sqrt3`` to ``\\sqrt{3}``; ``x = 5`` to ``5``;
spaces and a trailing ``.`` removed. It is written from that description, not copied.
"""

from __future__ import annotations

import re
from fractions import Fraction

# Longest final answer we extract. MATH's longest reference answers are ~150 characters; 10k
# leaves room for absurd-but-checkable answers (a 5000-digit number compares as a string).
# Everything in this module is linear in the answer length; sympy never sees more than
# math_reward.MAX_VERIFY_CHARS.
MAX_ANSWER_CHARS = 10_000
# How far back from the end of the output the GSM8K fallbacks (#### N, last number) look.
GSM8K_TAIL_CHARS = 1000
# Numbers longer than this are compared as canonical digit strings (never int()-converted).
MAX_NUMBER_DIGITS = 100


def _match_braced(text: str, open_idx: int, limit: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_idx``, scanning at most ``limit`` characters.

    Escaped braces (``\\{``, ``\\}``) do not count. Returns None when unbalanced within the limit.
    """
    depth = 0
    i = open_idx
    end = min(len(text), open_idx + limit + 2)
    while i < end:
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (``\{``, ``\}``, ``\\``)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


_REVERSED_BOX = re.compile(r"(?<![a-zA-Z])(dexob|xobf)\\")


def _last_box_command(text: str) -> tuple[int, str]:
    """(position, command) of the last ``\\boxed`` / ``\\fbox`` not followed by a letter, or (-1, "")."""
    pos = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if pos < 0:
        return -1, ""
    cmd = "\\boxed" if text.startswith("\\boxed", pos) else "\\fbox"
    end = pos + len(cmd)
    if end >= len(text) or not text[end].isalpha():
        return pos, cmd
    # ``\\boxedfoo`` is not ``\\boxed``. Search the reversed text (one C-speed pass) instead of
    # stepping back one rfind at a time, which is quadratic-ish on "\\boxedx" * 10**6.
    m = _REVERSED_BOX.search(text[::-1])
    if m is None:
        return -1, ""
    cmd = "\\boxed" if m.group(1) == "dexob" else "\\fbox"
    return len(text) - m.end(), cmd


def last_boxed_answer(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces handled), else None.

    Also accepts the brace-less form ``\\boxed 5`` (up to the next ``$`` or line end). If the last
    box is unbalanced, empty, or longer than ``max_chars``, the answer is None: the final answer
    is malformed and an earlier box is not silently used instead.
    """
    if not text:
        return None
    start, cmd = _last_box_command(text)
    if start < 0:
        return None
    i = start + len(cmd)
    n = len(text)
    while i < n and i - start < 16 and text[i] in " \t":
        i += 1
    if i >= n:
        return None
    if text[i] == "{":
        close = _match_braced(text, i, max_chars)
        if close is None:
            return None
        ans = text[i + 1 : close].strip()
    else:
        if i == start + len(cmd):  # ``\boxed5`` is not LaTeX; require the space
            return None
        tail = text[i : i + max_chars + 1]
        ans = re.split(r"[$\n]", tail, maxsplit=1)[0].strip()
        if len(ans) > max_chars:
            return None
    return ans or None


_HASH_NUM = re.compile(r"-?\$?\s*(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
_LAST_NUM = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def gsm8k_hash_answer(text: str) -> str | None:
    """The number after the last ``####`` (GSM8K's own answer format), commas removed."""
    if not text:
        return None
    pos = text.rfind("####")
    if pos < 0:
        return None
    tail = text[pos + 4 : pos + 4 + MAX_ANSWER_CHARS].split("\n", 1)[0]
    m = _HASH_NUM.search(tail)
    if not m:
        return None
    return m.group(0).replace("$", "").replace(",", "").replace(" ", "").rstrip(".") or None


def last_number(text: str, tail_chars: int = GSM8K_TAIL_CHARS) -> str | None:
    """The last number in the final ``tail_chars`` characters (commas removed), else None."""
    if not text:
        return None
    nums = _LAST_NUM.findall(text[-tail_chars:])
    for cand in reversed(nums):
        cand = cand.replace(",", "").rstrip(".")
        if cand not in ("", "-", "."):
            return cand
    return None


def brace_depth(s: str) -> int:
    """Maximum ``{`` nesting depth of ``s`` (unescaped braces only)."""
    depth = best = 0
    i = 0
    n = len(s)
    while i < n:
        ch = s[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
            best = max(best, depth)
        elif ch == "}":
            depth -= 1
        i += 1
    return best


# ---------------------------------------------------------------------------------------------
# normalisation

_UNIT_WORDS = (
    "square units|square unit|sq units|units|unit|square feet|square inches|square meters|"
    "square centimeters|square cm|cubic feet|cubic inches|cubic units|cubic centimeters|"
    "centimeters|centimeter|cm|millimeters|mm|kilometers|km|meters|meter|inches|inch|feet|foot|ft|"
    "yards|yard|miles|mile|mph|degrees|degree|cents|cent|dollars|dollar|hours|hour|minutes|minute|"
    "seconds|second|days|day|weeks|week|months|month|years|year|pounds|pound|ounces|ounce|gallons|"
    "gallon|liters|liter|grams|gram|kilograms|kg|calories|percent|points|point|students|people|"
    "ways|times|pages|marbles|eggs|apples|books|coins"
)
# "10 cm", "10 cm^2" at the end, after a digit or closing brace, separated by whitespace.
_TRAILING_UNIT_WORD = re.compile(r"(?<=[\d}])\s+(?:" + _UNIT_WORDS + r")(?:\^\{?[23]\}?)?\s*$")
# "10\text{ cm}", "864 \mbox{ inches}^2", "\frac{270}7\text{ degrees}" at the end.
_TRAILING_TEXT_UNIT = re.compile(
    r"\s*\\(?:text|textnormal|mbox|mathrm)\s*\{\s*(?:" + _UNIT_WORDS + r")\s*\}(?:\s*\^\s*\{?[23]\}?)?\s*$"
)
_TEXT_WRAP = re.compile(r"\\(?:text|textnormal|textbf|textit|mbox|mathrm|mathbf|mathit|operatorname)\s*\{([^{}]*)\}")
_WHITESPACE = re.compile(r"\s+")
_SPACING = re.compile(r"(?<!\\)(?:\\[,;:>]|\\q?quad(?![a-zA-Z])|\\ )|~")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![a-zA-Z])")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![a-zA-Z])|°")
_VAR_EQ = re.compile(r"^\s*(?:\\[a-zA-Z]+|[A-Za-z])(?:_\{?\w+\}?)?\s*(?:=|\\in(?![a-zA-Z]))\s*(?=\S)")
_SQRT_BARE = re.compile(r"\\sqrt\s*([0-9A-Za-z])")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_INT_SLASH = re.compile(r"^(-?\d+)/(\d+)$")


def _fix_fracs(s: str) -> str:
    """``\\frac12`` / ``\\frac1{2}`` / ``\\frac{1}2`` -> ``\\frac{1}{2}`` (one character per bare arg)."""
    if "\\frac" not in s:
        return s
    out = []
    i = 0
    n = len(s)
    while i < n:
        if s.startswith("\\frac", i) and not (i + 5 < n and s[i + 5].isalpha()):
            out.append("\\frac")
            i += 5
            for _ in range(2):
                if i >= n:
                    break
                if s[i] == "{":
                    close = _match_braced(s, i, n)
                    if close is None:
                        out.append(s[i:])
                        return "".join(out)
                    out.append(s[i : close + 1])
                    i = close + 1
                elif s[i] == "\\":  # \frac\pi2 : leave macros alone
                    break
                else:
                    out.append("{" + s[i] + "}")
                    i += 1
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _strip_outer_braces(s: str, max_layers: int = 4) -> str:
    """``{{5}}`` -> ``5``; at most ``max_layers`` layers (each check is a full scan)."""
    for _ in range(max_layers):
        if len(s) >= 2 and s[0] == "{" and _match_braced(s, 0, len(s)) == len(s) - 1:
            s = s[1:-1].strip()
        else:
            break
    return s


def normalize_answer(answer: str) -> str:
    """MATH-style canonical string for an extracted final answer (see module docstring)."""
    s = answer.strip()
    if not s:
        return s
    s = _WHITESPACE.sub(" ", s)  # first: keeps every later ``\s*`` linear
    s = s.replace("\\displaystyle", "")
    s = s.replace("\\!", "")
    s = _SPACING.sub(" ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT.sub("", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    # units: only when something remains in front of them
    stripped = _TRAILING_TEXT_UNIT.sub("", s)
    if stripped.strip():
        s = stripped
    stripped = _TRAILING_UNIT_WORD.sub("", s)
    if stripped.strip():
        s = stripped
    s = _TEXT_WRAP.sub(r"\1", s)
    s = _strip_outer_braces(s.strip())
    s = _VAR_EQ.sub("", s, count=1) if s.count("=") <= 1 else s
    s = _SQRT_BARE.sub(r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)  # ".5" -> "0.5"
    m = _INT_SLASH.match(s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = s.rstrip(".")
    return _strip_outer_braces(s)


# ---------------------------------------------------------------------------------------------
# exact number comparison (the cheap path that needs no sympy)

_INT = re.compile(r"^[+-]?\d+$")
_DEC = re.compile(r"^[+-]?(?:\d+\.\d*|\.\d+)$")
_FRAC = re.compile(r"^([+-]?)\\frac\{([+-]?\d+)\}\{(\d+)\}$")


def _canonical_int(s: str) -> str:
    neg = s.startswith("-")
    digits = s.lstrip("+-").lstrip("0") or "0"
    return ("-" if neg and digits != "0" else "") + digits


def _as_number(s: str) -> tuple[Fraction, int] | None:
    """(value, decimal places) for an int / decimal / ``\\frac{a}{b}`` string, else None."""
    if len(s) > MAX_NUMBER_DIGITS + 12:
        return None
    if _INT.match(s):
        return Fraction(int(s)), 0
    if _DEC.match(s):
        return Fraction(s), len(s.split(".", 1)[1])
    m = _FRAC.match(s)
    if m and m.group(3).lstrip("0"):
        sign = -1 if m.group(1) == "-" else 1
        return sign * Fraction(int(m.group(2)), int(m.group(3))), 0
    return None


def compare_numbers(gold: str, pred: str) -> bool | None:
    """Decide equality of two normalised answers if both are plain numbers, else None.

    Integers of any length compare as canonical digit strings (no ``int()``, so a 5000-digit
    answer costs microseconds). Equal values are True. Unequal values are False unless a
    decimal with 6+ places is involved; then math-verify's 6-place rounding decides (None).
    """
    if _INT.match(gold) and _INT.match(pred):
        return _canonical_int(gold) == _canonical_int(pred)
    a, b = _as_number(gold), _as_number(pred)
    if a is None or b is None:
        return None
    if a[0] == b[0]:
        return True
    if max(a[1], b[1]) >= 6:
        return None
    return False
