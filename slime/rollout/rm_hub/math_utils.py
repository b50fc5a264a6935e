"""slime's math answer checker (`slime.rollout.rm_hub.math_utils`): `\\boxed{}` extraction, the MATH dataset's
string normalisation (`mathd_normalize_answer`) and a sympy equivalence check (`grade_answer_sympy`).

`grade_answer_verl(solution, ground_truth)` is True when the last boxed answer of the solution equals the
(unboxed) ground truth under either check. The same semantics as slime's, for plugins that import it; `--rm-type
math` / `deepscaler` use `slime.rollout.rm_hub.math_rewards` (math-verify) instead. sympy parses only expressions
with few unknowns and no large powers (`should_allow_eval`), so a hostile answer cannot make it run for long.
"""

from __future__ import annotations

import re

import sympy
from pylatexenc import latex2text
from sympy.parsing import sympy_parser

from slime.rollout.rm_hub.math_dapo_utils import through_balanced_brace

BAD_SUBSTRINGS = ["^{", "^("]
BAD_REGEXES = [r"\^[0-9]+\^", r"\^[0-9][0-9]+"]
TUPLE_CHARS = "()[]"
UNIT_WORDS = ["degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
              "year", "foot", "feet", "inch", "yard"]


# ---------------------------------------------------------------- the MATH dataset's normalisation
def _fix_fracs(string: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}; a \\frac with fewer than two characters after it
    leaves the whole string unchanged."""
    pieces = string.split("\\frac")
    out = pieces[0]
    for piece in pieces[1:]:
        out += "\\frac"
        if piece[:1] == "{":
            out += piece
            continue
        if len(piece) < 2:
            return string
        numerator, rest = piece[0], piece[1:]
        if rest[0] != "{":
            out += "{" + numerator + "}{" + rest[0] + "}" + rest[1:]
        else:
            out += "{" + numerator + "}" + rest
    return out


def _fix_a_slash_b(string: str) -> str:
    """"3/4" -> "\\frac{3}{4}" for two plain integers."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    return f"\\frac{{{a}}}{{{b}}}" if string == f"{a}/{b}" else string


def _remove_right_units(string: str) -> str:
    if "\\text{ " in string:
        parts = string.split("\\text{ ")
        assert len(parts) == 2
        return parts[0]
    return string


def _fix_sqrt(string: str) -> str:
    """\\sqrt2 -> \\sqrt{2}."""
    if "\\sqrt" not in string:
        return string
    pieces = string.split("\\sqrt")
    return pieces[0] + "".join("\\sqrt" + (piece if piece[:1] == "{" else "{" + piece[0] + "}" + piece[1:])
                               for piece in pieces[1:])


def _strip_string(string: str) -> str:
    for before, after in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                          ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        string = string.replace(before, after)
    string = _remove_right_units(string)
    string = string.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5" -> "5"
        string = sides[1]
    string = _fix_sqrt(string).replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


def mathd_normalize_answer(answer: str | None) -> str | None:
    if answer is None:
        return None
    answer = answer.strip()
    try:
        match = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
        if match is not None:
            answer = match.group("text").strip()
        return _strip_string(answer)
    except Exception:  # noqa: BLE001 - a malformed answer stays as it is
        return answer


def grade_answer_mathd(given_answer: str, ground_truth: str) -> bool:
    return mathd_normalize_answer(ground_truth) == mathd_normalize_answer(given_answer)


# ---------------------------------------------------------------- sympy equivalence
def _sympy_parse(expr: str):
    safe = {k: v for k, v in sympy.__dict__.items() if not k.startswith("_")}
    return sympy_parser.parse_expr(
        expr.replace("^", "**"), local_dict={}, global_dict={"__builtins__": {}, **safe},
        transformations=sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,))


def _parse_latex(expr: str) -> str:
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for before, after in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(before, after)
    return expr.strip()


def _is_float(num: str) -> bool:
    try:
        float(num)
        return True
    except ValueError:
        return False


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):
        return False


def _is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def _strip_properly_formatted_commas(expr: str) -> str:
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
    while True:
        next_expr = pattern.sub("\\1\\3\\4", expr)
        if next_expr == expr:
            return next_expr
        expr = next_expr


def _str_is_int(x: str) -> bool:
    try:
        return _is_int(float(_strip_properly_formatted_commas(x)))
    except ValueError:
        return False


def _normalize(expr: str | None) -> str | None:
    """Answer normalisation before the sympy comparison: units, words, LaTeX to text, spacing, case."""
    if expr is None:
        return None
    match = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if match is not None:
        expr = match.group("text")
    for before, after in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                          ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(before, after)
    for unit in UNIT_WORDS:
        expr = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _parse_latex(expr)
        except Exception:  # noqa: BLE001 - pylatexenc could not read it: compare the raw text
            pass
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", "\\1+\\2", expr)  # a mixed number "7 3/4" -> "7+3/4"
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def should_allow_eval(expr: str) -> bool:
    """Only expressions with at most two unknowns and no large or nested powers go to sympy."""
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    if len(letters) > 2 or any(bad in expr for bad in BAD_SUBSTRINGS):
        return False
    return not any(re.search(bad, expr) for bad in BAD_REGEXES)


def are_equal_under_sympy(ground_truth_normalized: str, given_normalized: str) -> bool:
    try:
        expr = f"({ground_truth_normalized})-({given_normalized})"
        return should_allow_eval(expr) and sympy.simplify(_sympy_parse(expr)) == 0
    except Exception:  # noqa: BLE001 - sympy cannot parse or simplify it: not equal
        return False


def split_tuple(expr: str) -> list[str]:
    """The elements of a tuple or interval "(a, b)" / "[a, b)" (thousands separators kept inside numbers)."""
    expr = _strip_properly_formatted_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in TUPLE_CHARS and expr[-1] in TUPLE_CHARS and \
            all(ch not in expr[1:-1] for ch in TUPLE_CHARS):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def grade_answer_sympy(given_answer: str, ground_truth: str) -> bool:
    truth, given = _normalize(ground_truth), _normalize(given_answer)
    if truth is None:
        return False
    if truth == given:
        return True
    if not given:
        return False
    truth_elems, given_elems = split_tuple(truth), split_tuple(given)
    if len(truth_elems) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]):
        return False  # a tuple against an interval, or brackets that differ
    if len(truth_elems) != len(given_elems):
        return False
    for truth_elem, given_elem in zip(truth_elems, given_elems):
        if _is_frac(truth_elem) and _is_frac(given_elem):
            correct = truth_elem == given_elem  # a fraction must be given in the same (reduced) form
        elif _str_is_int(truth_elem) != _str_is_int(given_elem):
            correct = False
        else:
            correct = are_equal_under_sympy(truth_elem, given_elem)
        if not correct:
            return False
    return True


# ---------------------------------------------------------------- extraction and the verl-style grade
def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed...` (or `\\fbox...`) of `string` through its balanced closing brace, else None."""
    start = string.rfind("\\boxed")
    if start < 0:
        start = string.rfind("\\fbox")
        if start < 0:
            return None
    return through_balanced_brace(string, start)


def remove_boxed(s: str | None) -> str | None:
    """The content of `\\boxed{content}`, or None when `s` is not exactly that."""
    left = "\\boxed{"
    if not isinstance(s, str) or s[:len(left)] != left or s[-1:] != "}":
        return None
    return s[len(left):-1]


def extract_boxed_answer(solution: str) -> str | None:
    return remove_boxed(last_boxed_only_string(solution))


def extract_answer(passage: str) -> str | None:
    return extract_boxed_answer(passage) if "\\boxed" in passage else None


def grade_answer_verl(solution_str: str, ground_truth) -> bool:
    if not ground_truth:
        return False
    ground_truth = str(ground_truth)
    if "\\boxed" in ground_truth:
        ground_truth = extract_answer(ground_truth)
    given = extract_answer(solution_str)
    if given is None:
        return False
    return grade_answer_mathd(given, ground_truth) or grade_answer_sympy(given, ground_truth)
