"""Reflection over a framework's private internals: each one declared once, checked against the
installed code before it is used, and reached only through the check.

The DeepSpeed glue and ``megatron_patches`` reach into private internals of their frameworks (each
through its own ``internals.py``, which declares them and checks every one at first use). The shared
machinery is here: :class:`Internal` (one declared internal: module, name, kind, the parameters
used), :func:`resolve`/:func:`check_internals` (checked against the live objects with ``inspect``)
and :class:`FrameworkInternalsError`, which names the internal, what changed, and the installed and
supported versions; the code-level checks (who stores an attribute, who reads a name, the digest of a
copied body); and :class:`FrameworkInternals`, one framework's declared items with the checks (each
exists, is still read where it is replaced, a copied body is unchanged) and the access
(get/put/replace_method) every ``internals.py`` exposes.

The supported versions themselves, and the start-up check against them, are
:mod:`ds_lowcomm.versions`; it is imported where a message or a check needs it, inside the
functions, so that this file also loads alone (``tests/test_versions_digest.py`` runs
:func:`source_digest` on other Pythons from this file only).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass


def _versions():
    from . import versions

    return versions


class FrameworkInternalsError(RuntimeError):
    """A private framework internal an integration uses is missing or has another shape."""


KINDS = ("class", "function", "method", "field", "attribute", "instance")


@dataclass(frozen=True)
class Internal:
    """One private internal of a framework that an integration reads, replaces or copies.

    ``module`` and ``name`` (dotted inside the module: ``Class.attr``) locate it; ``kind`` is what
    it must be: ``class``; ``function`` (a module-level callable) or ``method`` (a function on a
    class), with ``params``; ``field`` (a dataclass field of the class before the last dot);
    ``attribute`` (present, any value); ``instance`` (set on constructed objects of the class
    before the last dot: the class is checked up front, the attribute where it is read, through
    :func:`read_instance`). ``params`` with ``match="call"``: the keywords ds_lowcomm calls it
    with, which must bind to the live signature (methods: after ``self``); with
    ``match="override"``: ds_lowcomm puts its own function in its place, so the live parameter
    names (after ``self``) must be exactly these, in order; with ``match="has"``: ds_lowcomm binds
    a call's arguments to the live signature and reads these by name, so they must be among the
    live parameters. ``use``: why it is needed."""

    module: str
    name: str
    kind: str
    params: tuple[str, ...] | None = None
    match: str = "call"
    use: str = ""

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def owner(self) -> str:
        """The dotted name of the class an ``instance``/``field``/``method`` item belongs to."""
        return self.name.rsplit(".", 1)[0]

    @property
    def attr(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def internals_error(distribution: str, item: Internal, problem: str) -> FrameworkInternalsError:
    versions = _versions()
    spec = versions.supported_range(distribution)
    use = f" (ds_lowcomm {item.use})" if item.use else ""
    return FrameworkInternalsError(
        f"{distribution} {versions.installed_version(distribution)}: {item.kind} {item.path}{use} {problem}; "
        f"ds_lowcomm supports {distribution}{spec}, where it is as declared: install a supported version "
        f"(pip install '{distribution}{spec}')")


def _lookup(distribution: str, item: Internal, dotted: str):
    import importlib

    try:
        obj = importlib.import_module(item.module)
    except ImportError as err:
        raise internals_error(distribution, item, f"cannot be imported ({err})") from None
    for part in dotted.split("."):
        try:
            obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
        except AttributeError:
            raise internals_error(distribution, item, f"is missing ({part!r} not found)") from None
    return obj


def unwrap(fn, name: str | None = None):
    """The function under ``fn``'s decorators: ``__wrapped__`` (functools.wraps), else, for a
    wrapper taking only ``*args, **kwargs`` (after ``self``), the function its closure holds named
    ``name`` (default: ``fn``'s own name), or its only function (DeepSpeed's ``stage_on_cpu`` keeps
    no ``__wrapped__``: its wrapper is ``wrapper(self, *args, **kwargs)`` around ``all_reduce``)."""
    name = name or getattr(fn, "__name__", None)
    fn = inspect.unwrap(fn)
    while inspect.isfunction(fn) and fn.__closure__:
        kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
        if kinds[-2:] != [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
            break
        inner = [c.cell_contents for c in fn.__closure__
                 if inspect.isfunction(getattr(c, "cell_contents", None)) and c.cell_contents is not fn]
        named = [f for f in inner if f.__name__ == name]
        if len(named) != 1 and len(inner) != 1:
            break
        fn = inspect.unwrap(named[0] if len(named) == 1 else inner[0])
    return fn


def signature(fn, name: str | None = None) -> inspect.Signature:
    """``inspect.signature`` of the function under ``fn``'s decorators (:func:`unwrap`)."""
    return inspect.signature(unwrap(fn, name))


def _check_params(distribution: str, item: Internal, fn) -> None:
    if item.params is None:
        return
    try:
        sig = signature(fn, item.attr)
    except (TypeError, ValueError) as err:
        raise internals_error(distribution, item, f"has no readable signature ({err})") from None
    live = list(sig.parameters)
    if item.kind == "method":
        live = live[1:]  # self
    if item.match == "has":
        missing = [p for p in item.params if p not in live]
        if missing:
            raise internals_error(distribution, item, f"now takes ({', '.join(live)}); ds_lowcomm reads its "
                                  f"argument(s) {', '.join(missing)} by name")
        return
    if item.match == "override":
        if tuple(live) != tuple(item.params):
            raise internals_error(distribution, item, f"now takes ({', '.join(live)}); ds_lowcomm replaces it "
                                  f"with a function taking ({', '.join(item.params)})")
        return
    try:  # does ds_lowcomm's call (these keywords) still bind?
        sig.bind(*([None] if item.kind == "method" else []), **{p: None for p in item.params})
    except TypeError as err:
        raise internals_error(distribution, item, f"now takes ({', '.join(live)}); ds_lowcomm calls it with "
                              f"({', '.join(item.params)}): {err}") from None


def resolve(distribution: str, item: Internal):
    """The live object ``item`` declares, checked: it exists, is of its kind and has the declared
    parameters (``inspect.signature`` of the installed code). An ``instance`` or ``field`` item
    gives its class. Raises :class:`FrameworkInternalsError` naming the item and the versions."""
    import dataclasses

    if item.kind not in KINDS:
        raise ValueError(f"{item.path}: kind must be one of {', '.join(KINDS)}; got {item.kind!r}")
    if item.kind in ("instance", "field"):
        cls = _lookup(distribution, item, item.owner)
        if not inspect.isclass(cls):
            raise internals_error(distribution, item, f"belongs to {item.owner}, which is no longer a class")
        if item.kind == "field":
            fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
            if item.attr not in fields:
                raise internals_error(distribution, item, f"is missing: {item.owner} has no dataclass field "
                                      f"{item.attr!r}")
        return cls
    obj = _lookup(distribution, item, item.name)
    if item.kind == "class" and not inspect.isclass(obj):
        raise internals_error(distribution, item, f"is no longer a class (a {type(obj).__name__})")
    if item.kind in ("function", "method"):
        fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        if not callable(fn):
            raise internals_error(distribution, item, f"is no longer callable (a {type(obj).__name__})")
        _check_params(distribution, item, fn)
    return obj


def check_internals(distribution: str, items) -> None:
    """:func:`resolve` every item; one :class:`FrameworkInternalsError` listing every problem."""
    problems = []
    for item in items:
        try:
            resolve(distribution, item)
        except FrameworkInternalsError as err:
            problems.append(str(err))
    if len(problems) == 1:
        raise FrameworkInternalsError(problems[0])
    if problems:
        raise FrameworkInternalsError(f"{len(problems)} private internals changed:\n" + "\n".join(problems))


def read_instance(distribution: str, item: Internal, obj):
    """``obj``'s attribute ``item`` declares (kind ``instance``), or the named error."""
    if item.kind != "instance":
        raise ValueError(f"{item.path} is a {item.kind}, not an instance attribute")
    try:
        return getattr(obj, item.attr)
    except AttributeError:
        raise internals_error(distribution, item, f"is missing on a {type(obj).__name__}") from None


# --- Code-level checks: what an attribute's class stores, who reads a name, a copied body ----------

def code_objects(code):
    """``code`` and every code object nested in it (inner functions, comprehensions)."""
    import types

    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from code_objects(const)


def functions_of(cls, package: str):
    """The code of every function defined on ``cls`` or its bases from ``package`` (a module
    prefix: the framework's own classes, not object's or torch's)."""
    for klass in cls.__mro__:
        if not klass.__module__.startswith(package):
            continue
        for value in vars(klass).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                value = value.fset or value.fget
            value = unwrap(value) if callable(value) else value
            if inspect.isfunction(value):
                yield from code_objects(value.__code__)


def stores_attribute(codes, attr: str) -> bool:
    """Whether any of ``codes`` stores an attribute named ``attr`` (``self.attr = ...``, or
    ``param.attr = ...`` for what a class sets on other objects)."""
    import dis

    # Read off the raw bytecode: many times faster than dis.get_instructions over a framework's
    # engine classes, which every rank pays at start-up. Only code naming attr is scanned.
    store, extended_arg = dis.opmap["STORE_ATTR"], dis.EXTENDED_ARG
    for code in codes:
        names = {i for i, name in enumerate(code.co_names) if name == attr}
        if not names:
            continue
        raw, extended = code.co_code, 0
        for at in range(0, len(raw), 2):
            op, arg = raw[at], raw[at + 1] | extended
            extended = arg << 8 if op == extended_arg else 0
            if op == store and arg in names:
                return True
    return False


def reads_name(fn, name: str) -> bool:
    """Whether ``fn``'s code (nested functions included) looks ``name`` up, as a global or an
    attribute: where ds_lowcomm replaces ``name``, the replacement is what ``fn`` uses."""
    return any(name in code.co_names for code in code_objects(unwrap(fn).__code__))


def body_digest(fn) -> str:
    """A digest of ``fn``'s body as tokens: comments, blank lines and indentation width left out
    (ds_lowcomm's copy of a framework function records the digest of the body it was copied from)."""
    return source_digest(inspect.cleandoc("\n" + inspect.getsource(unwrap(fn))) + "\n")


def source_digest(source: str) -> str:
    """:func:`body_digest` of a function's source text. The same on every Python: from 3.12 on
    (PEP 701) ``tokenize`` splits an f-string into FSTRING_START, its parts and FSTRING_END, where
    3.11 gave one STRING token; an f-string counts here as one token, its text as written."""
    import hashlib
    import io
    import tokenize

    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(pos: tuple[int, int]) -> int:
        return starts[pos[0] - 1] + pos[1]

    kept, depth, opened = [], 0, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        name = tokenize.tok_name[tok.type]
        if name.endswith("STRING_START") and name != "STRING":  # FSTRING_START (3.12+), TSTRING_START (3.14+)
            depth, opened = depth + 1, opened if depth else tok.start
            continue
        if name.endswith("STRING_END"):
            depth -= 1
            if not depth:
                kept.append(source[offset(opened):offset(tok.end)])
            continue
        if depth or tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER):
            continue
        kept.append(name if tok.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE) else tok.string)
    return hashlib.sha256(" ".join(kept).encode()).hexdigest()[:16]


# --- One framework's declared internals: the checks and the access, for each internals.py ---------

class FrameworkInternals:
    """One framework's declared private internals, the checks against the installed framework and
    the access to them. Each integration's ``internals.py`` declares its items and builds one of
    these; its module-level ``problems``, ``ensure_checked``, ``live``, ``get``, ``put``,
    ``replace_method``... are this object's methods.

    ``items``: every declared :class:`Internal`. ``looked_up``: ``(item, module, readers)``, the
    functions (in ``module``) that must still read ``item``'s name at each use, so that what the
    integration puts in its place is what the framework uses (a fourth element, when given, says
    instead what would go wrong were it no longer read there). ``copied``: item -> the
    :func:`body_digest` of the framework's body the integration's version was copied or written
    from. ``code_prefix``: the module prefix of the framework's own classes, whose code must store
    each ``instance`` item; ``stored_elsewhere``: item path -> ``(module, function)`` for one stored
    by a function outside its class. In the messages: ``user`` is who puts things in place
    ("ds_lowcomm"), ``copies`` finishes "has another body than the one ..." (whose version, made
    how, from where), ``label`` names the framework in the summary of several problems."""

    def __init__(self, distribution: str, items, looked_up, copied, code_prefix: str, *, user: str, copies: str,
                 label: str, stored_elsewhere=None):
        self.distribution = distribution
        self.items, self.looked_up, self.copied = tuple(items), tuple(looked_up), dict(copied)
        self.code_prefix, self.stored_elsewhere = code_prefix, dict(stored_elsewhere or {})
        self.user, self.copies, self.label = user, copies, label
        self.checked = False  # every item checked against the installed framework, once per process

    # --- the checks -----------------------------------------------------------------------------
    def stored_by_class(self, cls, attr: str) -> bool:
        """Whether the code of ``cls`` or of its bases from the framework stores an attribute ``attr``."""
        return stores_attribute(functions_of(cls, self.code_prefix), attr)

    def problems(self) -> list[str]:
        """Every way the installed framework differs from the declared items, lookups and copied
        bodies, one message each (empty: as declared; a missing reader is named once)."""
        dist, out = self.distribution, []

        def note(check, *args):
            try:
                check(*args)
            except FrameworkInternalsError as err:
                out.append(str(err))

        def declared(item):
            live = resolve(dist, item)
            if item.kind != "instance":
                return
            if item.path in self.stored_elsewhere:
                module, function = self.stored_elsewhere[item.path]
                where = f"{module}.{function}"
                fn = unwrap(resolve(dist, Internal(module, function, "function")))
                stored = stores_attribute(code_objects(fn.__code__), item.attr)
            else:
                where = f"the code of {item.owner}"
                stored = self.stored_by_class(live, item.attr)
            if not stored:
                raise internals_error(dist, item, f"is no longer set by {where}")

        def read_by(item, module, reader, why=None):
            fn = resolve(dist, Internal(module, reader, "method" if "." in reader else "function"))
            if not reads_name(fn, item.attr):
                why = why or f"what {self.user} puts in its place would not be used"
                raise internals_error(dist, item, f"is no longer read by {module}.{reader}, so {why}")

        def same_body(item, digest):
            if body_digest(resolve(dist, item)) != digest:
                raise internals_error(dist, item, f"has another body than the one {self.copies}")

        for item in self.items:
            note(declared, item)
        for item, module, readers, *why in self.looked_up:
            for reader in readers:
                note(read_by, item, module, reader, *why)
        for item, digest in self.copied.items():
            note(same_body, item, digest)
        return list(dict.fromkeys(out))

    def ensure_checked(self) -> str:
        """The supported-version check (:func:`ds_lowcomm.versions.check_supported`), then (once per process) every
        internal against the installed framework: one :class:`FrameworkInternalsError` listing
        every problem. Returns the installed version."""
        version = _versions().check_supported(self.distribution)
        if not self.checked:
            found = self.problems()
            if len(found) == 1:
                raise FrameworkInternalsError(found[0])
            if found:
                raise FrameworkInternalsError(f"{len(found)} private {self.label} internals changed:\n"
                                              + "\n".join(found))
            self.checked = True
        return version

    # --- access ---------------------------------------------------------------------------------
    def live(self, item: Internal):
        """The live class / function / method / attribute ``item`` declares (checked: :func:`resolve`)."""
        return resolve(self.distribution, item)

    def get(self, obj, item: Internal):
        """``obj``'s instance attribute ``item``; the named error where it is missing."""
        return read_instance(self.distribution, item, obj)

    def put(self, obj, item: Internal, value) -> None:
        """Set ``obj``'s instance attribute ``item``, which must already be there (a renamed one
        would be created silently and never read by the framework)."""
        self.get(obj, item)
        setattr(obj, item.attr, value)

    def static(self, item: Internal):
        """The function of a declared static method (a ``function`` item named ``Class.name``)."""
        obj = self.live(item)
        return obj.__func__ if isinstance(obj, staticmethod) else obj

    def method(self, obj, item: Internal, of_class: bool = False):
        """``obj``'s method ``item`` (bound; ``of_class``: its class's, not one replaced on the
        instance); the named error where it is missing."""
        import types

        if item.kind != "method":
            raise ValueError(f"{item.path} is a {item.kind}, not a method")
        try:
            return types.MethodType(getattr(type(obj), item.attr), obj) if of_class else getattr(obj, item.attr)
        except AttributeError:
            raise internals_error(self.distribution, item, f"is missing on a {type(obj).__name__}") from None

    @staticmethod
    def _stands_in(item: Internal, fn, takes_self: bool = False) -> None:
        try:
            inspect.signature(fn).bind(*([None] if takes_self else []), **{p: None for p in item.params})
        except TypeError as err:
            raise TypeError(f"{fn.__qualname__} cannot stand in for {item.path}({', '.join(item.params)}): "
                            f"{err}") from None

    def check_override(self, item: Internal, fn, takes_self: bool = False) -> None:
        """``fn`` (ours, put in place of the method ``item`` declares as ``override``;
        ``takes_self``: a function on a subclass, else one set on an instance) accepts what the
        framework passes the method: its declared parameters, as keywords. A mismatch is ours to
        fix: TypeError."""
        if item.match != "override":
            raise ValueError(f"{item.path} is not declared as replaced (match={item.match!r})")
        self._stands_in(item, fn, takes_self)

    def replace_method(self, obj, item: Internal, fn) -> None:
        """Put ``fn`` in place of the method ``item`` on this one object (its class and every other
        instance keep the framework's). ``fn`` must take the declared parameters by name
        (``override``: exactly the framework's; ``has``: those it reads, the rest passed on)."""
        if item.match not in ("override", "has"):
            raise ValueError(f"{item.path} is not declared as replaced (match={item.match!r})")
        owner = self.live(Internal(item.module, item.owner, "class"))
        if not isinstance(obj, owner):
            raise TypeError(f"{item.path}: expected a {owner.__name__}, got a {type(obj).__name__}")
        self.method(obj, item)
        self._stands_in(item, fn)
        setattr(obj, item.attr, fn)
