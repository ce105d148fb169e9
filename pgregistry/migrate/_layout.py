"""Lines the rewrite made longer than the tree's line length, split as black splits them.

Only a statement, ``def``, ``if``, ``elif`` or ``while`` line the rewrite changed, that was one
physical line and no longer fits (its trailing comment counted, as black counts it, and left after
its last line), is split; every other byte stays as the author wrote it. The shapes black gives
(black 24 to 26; the tests hold its output):

- an assignment's value, a ``return``'s value, an ``assert``'s test (without a message) or an
  expression statement with two or more delimiters of its lowest priority at the top (a tuple, a
  conditional, an ``and`` / ``or`` chain of three, ...), or one that does not end in a call: in
  parentheses, on a line of its own; where that line is still too long, split at those delimiters
  (one element a line with a trailing comma for a tuple; ``if`` and ``else`` parts a line each; one
  operand a line, its operator first);
- else (it ends in a call): that last call's arguments on a line of their own, else one a line with
  a trailing comma (calls without arguments after it, ``f(...).keys()``, are looked through, as
  black skips empty brackets);
- inside brackets (an argument, an element, an operand), an arithmetic operation: one operand a
  line, its operator first, at the same indentation (black's split at the delimiters before its
  right-hand split);
- a ``def`` line: its parameters on a line of their own, else one a line with a trailing comma;
- an ``if`` / ``elif`` / ``while`` line: its condition as a statement's value (in parentheses on a
  line of its own, or its last call's arguments);
- an argument the rewrite changed on a line of its own in a call that already spans lines (one
  argument a line): as a statement's value, after its ``name=`` (a conditional in parentheses on a
  line of its own, a call's arguments on a line of their own, ...), its comma kept at the end;
- a value ``not (``, one line, ``)`` (the author's layout) whose line no longer fits: split at its
  delimiters as a value in parentheses is;
- a call's arguments on one line of their own (``f(``, the arguments, ``)``) after which the rewrite
  added a keyword on a line of its own, where that line with the comma added no longer fits: one
  argument a line with a trailing comma;
- a dict comprehension's key in parentheses on a line of its own: ``(``, the key (split at its
  delimiters where it still does not fit), ``): value``.

Anything else (a long line of another shape) is left as it is.
"""

from __future__ import annotations

import libcst as cst

__all__ = [
    "split_argument_line",
    "split_arguments",
    "split_condition",
    "split_header",
    "split_key",
    "split_lengthened_argument_line",
    "split_statement",
]

_CODE = cst.Module([])


def _source_of(node: cst.CSTNode) -> str:
    return _CODE.code_for_node(node)


def _parse_or_none(text: str) -> cst.BaseStatement | None:
    """``text`` parsed; None where the new layout does not parse.

    Such a layout is a shape this module does not know: the line is then left as it is, never
    broken."""
    try:
        return cst.parse_statement(text)
    except cst.ParserSyntaxError:
        return None


def _fits_width(indent: int, text: str, width: int) -> bool:
    return indent + len(text) <= width


def _parts_at_delimiters(
    value: cst.BaseExpression,
) -> list[tuple[str, cst.BaseExpression, str]] | None:
    """Each operand of ``value`` split at its lowest-priority delimiters at the top, with its text.

    As (text before, operand, text after); None when it has none."""
    if value.lpar or _has_starred_element(value):
        return None
    if isinstance(value, cst.Tuple):
        return [("", element.value, ",") for element in value.elements]
    if isinstance(value, cst.IfExp):
        return [("", value.body, ""), ("if ", value.test, ""), ("else ", value.orelse, "")]
    if isinstance(value, cst.BooleanOperation):
        operator = _source_of(value.operator).strip() + " "
        left = value.left
        same = (
            isinstance(left, cst.BooleanOperation)
            and not left.lpar
            and type(left.operator) is type(value.operator)
        )
        first = (_parts_at_delimiters(left) or []) if same else [("", left, "")]
        return [*first, (operator, value.right, "")]
    if isinstance(value, cst.Comparison):
        operands = (
            (_source_of(t.operator).strip() + " ", t.comparator, "") for t in value.comparisons
        )
        return [("", value.left, ""), *operands]
    return None


def _has_starred_element(value: cst.BaseExpression) -> bool:
    """Whether ``value`` is a tuple, list or set with a ``*element`` (left as it is)."""
    elements = value.elements if isinstance(value, (cst.Tuple, cst.List, cst.Set)) else ()
    return any(isinstance(element, cst.StarredElement) for element in elements)


#: The arithmetic operators of one priority (black splits at each of a chain of them, ``**`` never).
_PRIORITIES: tuple[tuple[type[cst.BaseBinaryOp], ...], ...] = (
    (cst.Add, cst.Subtract),
    (cst.Multiply, cst.Divide, cst.FloorDivide, cst.Modulo, cst.MatrixMultiply),
    (cst.LeftShift, cst.RightShift),
    (cst.BitAnd,),
    (cst.BitXor,),
    (cst.BitOr,),
)


def _operator_chain(value: cst.BinaryOperation) -> list[tuple[str, cst.BaseExpression]]:
    """(operator before, operand) of each operand in ``value``'s top chain of one priority.

    The chain of the operators of its own priority at the top (``a + b - c``: ``a``, ``+ b``,
    ``- c``); empty for ``**``."""
    group = next(
        (operators for operators in _PRIORITIES if isinstance(value.operator, operators)), None
    )
    if group is None:
        return []
    left = value.left
    chained = (
        isinstance(left, cst.BinaryOperation) and not left.lpar and isinstance(left.operator, group)
    )
    first = (
        _operator_chain(left) if isinstance(left, cst.BinaryOperation) and chained else [("", left)]
    )
    return [*first, (_source_of(value.operator).strip() + " ", value.right)]


def _split_call(value: cst.BaseExpression) -> tuple[cst.Call, str] | None:
    """The call whose closing parenthesis ends ``value`` (:func:`_last_call`), and the text after.

    Looking through calls without arguments on its result (``f(x).keys()``: ``f(x)``, as black skips
    empty brackets)."""
    call = _last_call(value)
    suffix = ""
    while (
        call is not None
        and not call.args
        and isinstance(call.func, cst.Attribute)
        and not call.func.lpar
    ):
        inner = call.func.value
        if not isinstance(inner, cst.Call) or inner.lpar:
            break
        suffix = _source_of(call)[len(_source_of(inner)) :] + suffix
        call = inner
    return None if call is None else (call, suffix)


def _last_call(value: cst.BaseExpression) -> cst.Call | None:
    """The call whose closing parenthesis ends ``value``, if one does."""
    while not value.rpar:
        if isinstance(value, cst.Call):
            return value
        if isinstance(value, (cst.BooleanOperation, cst.BinaryOperation)):
            value = value.right
        elif isinstance(value, cst.Comparison):
            value = value.comparisons[-1].comparator
        elif isinstance(value, cst.UnaryOperation):
            value = value.expression
        else:
            return None
    return None


def _argument_head(arg: cst.Arg) -> str:
    """What comes before an argument's value: ``name=``, ``*``, ``**`` or nothing."""
    if arg.keyword is not None:
        return f"{arg.keyword.value}="
    return arg.star if isinstance(arg.star, str) else ""


def _black_lines(
    head: str,
    value: cst.BaseExpression,
    tail: str,
    indent: int,
    width: int,
    unit: str,
    bracketed: bool = True,
) -> list[str]:
    """``head``, ``value`` and ``tail`` (``indent`` columns in) as the lines black writes.

    Each line is indented relative to the first; ``bracketed``: the line is inside brackets (not a
    statement's or a condition's)."""
    body = _source_of(value)
    if _fits_width(indent, head + body + tail, width):
        return [head + body + tail]
    operands = (
        _operator_chain(value)
        if bracketed and isinstance(value, cst.BinaryOperation) and not value.lpar
        else []
    )
    # Inside brackets black splits at the operators first, one operand a line, its operator first.
    if operands:
        last = len(operands) - 1
        return [
            line
            for index, (operator, operand) in enumerate(operands)
            for line in _black_lines(
                (head if index == 0 else "") + operator,
                operand,
                tail if index == last else "",
                indent,
                width,
                unit,
            )
        ]
    if _is_lambda_call(value):
        return _lambda_call_lines(head, value, tail, indent, width, unit)
    parts = _parts_at_delimiters(value)
    found = _split_call(value)
    call, suffix = found if found is not None else (None, "")
    deeper = indent + len(unit.expandtabs(4))
    if (
        call is not None
        and call.args
        and (parts is None or len(parts) < 3 and not isinstance(value, cst.Tuple))
    ):
        before = (
            head
            + body[: len(body) - len(_source_of(call)) - len(suffix)]
            + _source_of(call.func)
            + "("
        )
        if _fits_width(
            indent, before, width
        ):  # black splits the last call, omitting optional parentheses
            arguments = [
                _source_of(arg.with_changes(comma=cst.MaybeSentinel.DEFAULT)).strip()
                for arg in call.args
            ]
            one = ", ".join(arguments)
            if _fits_width(deeper, one, width):
                inner = [one]
            else:
                # One a line (a trailing comma where there are several), each split in turn if
                # still too long.
                comma = "," if len(call.args) > 1 else ""
                inner = [
                    line
                    for arg in call.args
                    for line in _black_lines(
                        _argument_head(arg), arg.value, comma, deeper, width, unit
                    )
                ]
            return [before, *(unit + line for line in inner), ")" + suffix + tail]
    if (
        isinstance(value, (cst.List, cst.Set))
        and not value.lpar
        and value.elements
        and not _has_starred_element(value)
    ):
        opening, closing = ("[", "]") if isinstance(value, cst.List) else ("{", "}")
        inner = [
            line
            for element in value.elements
            for line in _black_lines("", element.value, ",", deeper, width, unit)
        ]
        return [head + opening, *(unit + line for line in inner), closing + tail]
    if parts is None:
        return [head + body + tail]
    inner = (
        [body] if _fits_width(deeper, body, width) else _one_part_a_line(parts, deeper, width, unit)
    )
    return [head + "(", *(unit + line for line in inner), ")" + tail]


def _is_lambda_call(value: cst.BaseExpression) -> bool:
    """Whether ``value`` is ``(lambda ...: ...)(arguments)`` (a helper argument read once)."""
    return (
        isinstance(value, cst.Call)
        and not value.lpar
        and isinstance(value.func, cst.Lambda)
        and len(value.func.lpar) == 1
        and not value.func.body.lpar
    )


def _lambda_call_lines(
    head: str, value: cst.BaseExpression, tail: str, indent: int, width: int, unit: str
) -> list[str]:
    """``(lambda ...: ...)(arguments)`` as black writes it where too long.

    The lambda on lines of its own in parentheses, its body in parentheses split at its
    delimiters, the arguments after the closing parenthesis."""
    assert isinstance(value, cst.Call) and isinstance(value.func, cst.Lambda)
    function = value.func
    lambda_head = _source_of(function.with_changes(lpar=[], rpar=[], body=cst.Name("_")))[:-1]
    parts = _parts_at_delimiters(function.body)
    body_indent = indent + 2 * len(unit.expandtabs(4))
    body = _source_of(function.body)
    inner = (
        [body]
        if parts is None or _fits_width(body_indent, body, width)
        else _one_part_a_line(parts, body_indent, width, unit)
    )
    arguments = _source_of(value)[len(_source_of(function)) :]
    return [
        head + "(",
        unit + lambda_head + "(",
        *(unit * 2 + line for line in inner),
        unit + ")",
        ")" + arguments + tail,
    ]


def _one_part_a_line(
    parts: list[tuple[str, cst.BaseExpression, str]], indent: int, width: int, unit: str
) -> list[str]:
    """The lines of ``parts`` (of :func:`_parts_at_delimiters`), one part a line.

    Each is split in turn where still too long."""
    return [
        line
        for before, operand, after in parts
        for line in _black_lines(before, operand, after, indent, width, unit)
    ]


def split_statement(
    line: cst.SimpleStatementLine, indent: int, width: int, unit: str
) -> cst.SimpleStatementLine:
    """``line`` (``indent`` columns in), split where it, or its value on its own line, is too long.

    Where it is one physical line longer than ``width``, or where its value, in parentheses on a
    line of its own (``x = (``, the value, ``)``), no longer fits that line."""
    if len(line.body) != 1:
        return line
    small = line.body[0]
    text = _source_of(small)
    if isinstance(small, (cst.Assign, cst.AnnAssign, cst.AugAssign)) and small.value is not None:
        value = small.value
    elif isinstance(small, (cst.Return, cst.Expr)) and small.value is not None:
        value = small.value
    elif isinstance(small, cst.Assert) and small.msg is None:
        value = small.test
    else:
        return line
    head = text[: len(text) - len(_source_of(value))]
    if not text.endswith(_source_of(value)) or "\n" in head:
        return line
    if (
        "\n" in text
    ):  # only the layout ``(`` (``not (``), one line, ``)``, without comments, is laid out again
        prefix, enclosed = "", value
        if isinstance(value, cst.UnaryOperation) and not value.lpar:
            prefix, enclosed = _source_of(value.operator), value.expression
        bare = enclosed.with_changes(lpar=[], rpar=[])
        inner = _source_of(bare)
        laid_out = f"{prefix}(\n{unit}{inner}\n)"
        if len(enclosed.lpar) != 1 or "\n" in inner or "#" in text or _source_of(value) != laid_out:
            return line
        deeper = indent + len(unit.expandtabs(4))
        parts = _parts_at_delimiters(bare)
        if parts is None or _fits_width(deeper, inner, width):
            return line
        lines = [
            f"{head}{prefix}(",
            *(unit + part for part in _one_part_a_line(parts, deeper, width, unit)),
            ")",
        ]
    elif _fits_width(
        indent, text + (comment := _source_of(line.trailing_whitespace).rstrip("\n")), width
    ):
        return line
    elif isinstance(value, cst.BinaryOperation) and not value.lpar and _last_call(value) is None:
        # ``x = a * 2``: black puts the value in parentheses on a line of its own (where it then
        # fits)
        body = _source_of(value)
        lines = (
            [f"{head}(", unit + body, ")"]
            if _fits_width(indent + len(unit.expandtabs(4)), body, width)
            else [text]
        )
    else:
        # a trailing comment counts: black leaves it after the last line
        lines = _black_lines(head, value, comment, indent, width, unit, bracketed=False)
    if len(lines) == 1:
        return line
    parsed = _parse_or_none("\n".join(lines) + "\n")
    return (
        line.with_changes(body=parsed.body) if isinstance(parsed, cst.SimpleStatementLine) else line
    )


def _parameter_texts(params: cst.Parameters) -> list[str]:
    """Each parameter's text, with the ``/`` and bare ``*`` markers, in order."""

    def param_text(param: cst.Param, star: str = "") -> str:
        alone = param.with_changes(
            comma=cst.MaybeSentinel.DEFAULT,
            whitespace_after_param=cst.SimpleWhitespace(""),
            star=param.star if isinstance(param.star, str) else star,
        )
        return _source_of(alone).strip()

    items = [param_text(p) for p in params.posonly_params]
    if params.posonly_params:
        items.append("/")
    items += [param_text(p) for p in params.params]
    if isinstance(params.star_arg, cst.Param):
        items.append(param_text(params.star_arg, "*"))
    elif isinstance(params.star_arg, cst.ParamStar):
        items.append("*")
    items += [param_text(p) for p in params.kwonly_params]
    if params.star_kwarg is not None:
        items.append(param_text(params.star_kwarg, "**"))
    return items


def split_header(function: cst.FunctionDef, indent: int, width: int, unit: str) -> cst.FunctionDef:
    """``function`` (``indent`` columns in) with its parameters laid out again where too long.

    Where a line of its header is longer than ``width`` (the ``def`` line, or the line of parameters
    of a header already split)."""
    header = _source_of(
        function.with_changes(
            decorators=[],
            leading_lines=[],
            lines_after_decorators=[],
            body=cst.SimpleStatementSuite([cst.Pass()]),
        )
    )
    header = header.rstrip("\n").removesuffix(" pass").rstrip()
    if "#" in header or all(_fits_width(indent, line, width) for line in header.splitlines()):
        return function  # it fits (or holds a comment, which a new layout would have to move)
    items = _parameter_texts(function.params)
    one = ", ".join(items)
    inner = (
        [f"{unit}{one}"]
        if _fits_width(indent + len(unit), one, width)
        else [f"{unit}{item}," for item in items]
    )
    parsed = _parse_or_none("\n".join(["def f(", *inner, "): pass"]) + "\n")
    if not isinstance(parsed, cst.FunctionDef):
        return function
    return function.with_changes(
        params=parsed.params, whitespace_before_params=parsed.whitespace_before_params
    )


def split_condition(
    node: cst.If | cst.While, keyword: str, indent: int, width: int, unit: str
) -> cst.If | cst.While:
    """``node`` with its condition laid out as black lays it out where its header is too long.

    ``keyword`` is ``if``, ``elif`` or ``while``; ``node`` is ``indent`` columns in; too long is one
    physical line longer than ``width``."""
    before, after = (
        ("whitespace_before_test", "whitespace_after_test")
        if isinstance(node, cst.If)
        else ("whitespace_after_while", "whitespace_before_colon")
    )
    test = _source_of(node.test)
    header = (
        f"{keyword}{_source_of(getattr(node, before))}{test}{_source_of(getattr(node, after))}:"
    )
    if "\n" in test or _fits_width(indent, header, width):
        return node
    lines = _black_lines(f"{keyword} ", node.test, ":", indent, width, unit, bracketed=False)
    if len(lines) == 1:
        return node
    parsed = _parse_or_none(
        "\n".join(["if" + lines[0].removeprefix(keyword), *lines[1:]]) + f"\n{unit}pass\n"
    )
    if not isinstance(parsed, cst.If):
        return node
    return node.with_changes(
        **{
            "test": parsed.test,
            before: parsed.whitespace_before_test,
            after: parsed.whitespace_after_test,
        }
    )


def _own_line(whitespace: cst.BaseParenthesizableWhitespace) -> str | None:
    """The indentation, relative to the block's, of the line that ``whitespace`` starts; else None.

    ``whitespace`` starts a line where it ends one without a comment and starts the next at the
    block's indentation or deeper."""
    if not isinstance(whitespace, cst.ParenthesizedWhitespace) or not whitespace.indent:
        return None
    return None if whitespace.first_line.comment else whitespace.last_line.value


def _before_argument(call: cst.Call, index: int) -> cst.BaseParenthesizableWhitespace:
    """The whitespace between the argument ``index`` of ``call`` and what comes before it."""
    if index == 0:
        return call.whitespace_before_args
    comma = call.args[index - 1].comma
    return comma.whitespace_after if isinstance(comma, cst.Comma) else cst.SimpleWhitespace("")


def split_arguments(
    call: cst.Call, original: cst.Call, indent: int, width: int, unit: str
) -> cst.Call:
    """``call`` with each argument the rewrite made too long for its line laid out as black does.

    ``call`` is in a block ``indent`` columns in; ``original`` is it before the rewrite. An argument
    is laid out again when it sits on a line of its own, the rewrite changed it and it no longer
    fits that line; every other argument stays as the author wrote it."""
    args = list(call.args)
    for index, arg in enumerate(call.args):
        comma = arg.comma
        opening = _own_line(_before_argument(call, index))
        closing = (
            comma.whitespace_after if isinstance(comma, cst.Comma) else arg.whitespace_after_arg
        )
        if opening is None or _own_line(closing) is None or index >= len(original.args):
            continue
        bare = arg.with_changes(
            comma=cst.MaybeSentinel.DEFAULT, whitespace_after_arg=cst.SimpleWhitespace("")
        )
        text, value = _source_of(bare), _source_of(arg.value)
        tail = "," if isinstance(comma, cst.Comma) else ""
        column = indent + len(opening.expandtabs(4))
        if "\n" in text or not text.endswith(value) or _fits_width(column, text + tail, width):
            continue
        if text == _source_of(
            original.args[index].with_changes(
                comma=cst.MaybeSentinel.DEFAULT, whitespace_after_arg=cst.SimpleWhitespace("")
            )
        ):
            continue  # the author's own long line
        lines = _black_lines(text[: len(text) - len(value)], arg.value, tail, column, width, unit)
        if len(lines) == 1:
            continue
        try:
            parsed = cst.parse_expression(
                "f(\n" + "".join(f"{opening}{line}\n" for line in lines) + ")"
            )
        except cst.ParserSyntaxError:
            continue
        if isinstance(parsed, cst.Call) and len(parsed.args) == 1:
            args[index] = arg.with_changes(value=parsed.args[0].value)
    return call.with_changes(args=args)


def split_key(comprehension: cst.DictComp, indent: int, width: int, unit: str) -> cst.DictComp:
    """``comprehension`` with its key laid out as black does where the rewrite made it too long.

    The comprehension is in a block ``indent`` columns in; its key is in parentheses, on a line of
    its own that the rewrite made longer than ``width``. The layout: ``(``, the key (split at its
    lowest-priority delimiters where it still does not fit), ``): value``."""
    key = comprehension.key
    opening = _own_line(comprehension.lbrace.whitespace_after)
    if (
        opening is None
        or _own_line(comprehension.for_in.whitespace_before) is None
        or len(key.lpar) != 1
    ):
        return comprehension
    bare = key.with_changes(lpar=[], rpar=[])
    after = (
        f"){_source_of(comprehension.whitespace_before_colon)}:"
        f"{_source_of(comprehension.whitespace_after_colon)}"
        f"{_source_of(comprehension.value)}"
    )
    column = indent + len(opening.expandtabs(4))
    inner = _source_of(bare)
    if (
        "\n" in inner + after
        or _fits_width(column, f"({inner}{after}", width)
        or _source_of(key) != f"({inner})"
    ):
        return comprehension
    deeper = column + len(unit.expandtabs(4))
    parts = _parts_at_delimiters(bare)
    lines = (
        _one_part_a_line(parts, deeper, width, unit)
        if parts is not None and not _fits_width(deeper, inner, width)
        else _black_lines("", bare, "", deeper, width, unit)
    )
    text = "\n".join(
        [
            "{",
            f"{opening}(",
            *(f"{opening}{unit}{line}" for line in lines),
            f"{opening}{after}",
            f"{opening}for _ in _",
            "}",
        ]
    )
    try:
        parsed = cst.parse_expression(text)
    except cst.ParserSyntaxError:
        return comprehension
    return (
        comprehension.with_changes(key=parsed.key)
        if isinstance(parsed, cst.DictComp)
        else comprehension
    )


def _argument_line(call: cst.Call) -> tuple[str, str, str] | None:
    """The one line of ``call``'s arguments, with its and the closing parenthesis's indentation.

    As (its indentation, its text, the closing parenthesis's indentation), where the arguments are
    laid out ``f(``, the arguments on one line, ``)`` (without comments); else None."""
    lines = _source_of(call).split("\n")
    opening = _own_line(call.whitespace_before_args)
    if opening is None or len(lines) != 3 or "#" in lines[1] or not lines[1].startswith(opening):
        return None
    closing = lines[2].removesuffix(")")
    return (opening, lines[1][len(opening) :], closing) if not closing.strip() else None


def split_argument_line(
    call: cst.Call, before: cst.Call, original: cst.Call, indent: int, width: int, unit: str
) -> cst.Call:
    """``call`` with one argument a line where the keyword it adds made its argument line too long.

    ``call`` (in a block ``indent`` columns in) is ``before`` with a keyword argument added on a
    line of its own after its one line of arguments (:func:`_argument_line`). Its arguments go one a
    line with a trailing comma, as black lays them out, where that line, with the comma added, no
    longer fits and fitted as the author wrote it (``original``); else ``call``."""
    return _one_argument_a_line(call, before, original, ",", indent, width, unit)


def split_lengthened_argument_line(
    call: cst.Call, original: cst.Call, indent: int, width: int, unit: str
) -> cst.Call:
    """``call`` with one argument a line where the rewrite made its one line of arguments too long.

    As :func:`split_argument_line`, for an argument the rewrite changed on that line (a read made
    ``pg_group(getattr(self, "pg_collection", None), "cp")``): black gives each argument its own
    line once they no longer fit on one. A line the author wrote too long is left."""
    return _one_argument_a_line(call, call, original, "", indent, width, unit)


def _one_argument_a_line(
    call: cst.Call,
    before: cst.Call,
    original: cst.Call,
    tail: str,
    indent: int,
    width: int,
    unit: str,
) -> cst.Call:
    """``call``'s arguments one a line where ``before``'s argument line plus ``tail`` is too long.

    Only where the author's (``original``'s) argument line fitted; else ``call``."""
    laid_out, authors = _argument_line(before), _argument_line(original)
    if laid_out is None or authors is None or not call.args:
        return call
    opening, text, closing = laid_out
    column = indent + len(opening.expandtabs(4))
    if _fits_width(column, text + tail, width) or not _fits_width(column, authors[1], width):
        return call
    lines = [
        line
        for arg in call.args
        for line in _black_lines(_argument_head(arg), arg.value, ",", column, width, unit)
    ]
    try:
        parsed = cst.parse_expression(
            "f(\n" + "".join(f"{opening}{line}\n" for line in lines) + f"{closing})"
        )
    except cst.ParserSyntaxError:
        return call
    if not isinstance(parsed, cst.Call) or len(parsed.args) != len(call.args):
        return call
    return call.with_changes(args=parsed.args, whitespace_before_args=parsed.whitespace_before_args)
