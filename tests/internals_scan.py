"""The names a package defines itself, for the internals tests (test_deepspeed_internals.py,
test_megatron_internals.py): a private name read outside a package's internals.py is the
package's own only when it is one of these. A plain module (no torch, no framework), so that the
workers those tests spawn, which import the test modules, import nothing more through it."""

import ast


def own_names(paths, subscript_keys: bool = False) -> set[str]:
    """Names the code in ``paths`` defines itself: functions, classes, and the attributes and
    variables it stores (``subscript_keys``: also the string keys it stores, ``d["_sw_real"] = ...``)."""
    own = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (subscript_keys and isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
                own.add(node.slice.value)
    return own
