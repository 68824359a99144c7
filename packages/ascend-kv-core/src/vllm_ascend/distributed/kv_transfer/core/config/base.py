# SPDX-License-Identifier: Apache-2.0
"""Typed, validated configuration sections.

A connector's ``kv_connector_extra_config`` is a free-form dict in vLLM. Each
connector describes the keys it reads as a frozen dataclass deriving from
:class:`ConfigSection`, with :func:`option` fields that carry the documentation.
:meth:`ConfigSection.from_dict` then checks every value and raises a
:class:`~vllm_ascend.distributed.kv_transfer.core.errors.ConfigError` whose
message names the key, the value and what would be accepted. The same
descriptions feed ``vllm-ascend-kv doctor`` and the generated configuration
reference in the docs, so the three cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

from ..errors import ConfigError
from .sizes import format_size, parse_size

logger = logging.getLogger(__name__)

T = TypeVar("T", bound="ConfigSection")

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def option(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    default_factory: Any = dataclasses.MISSING,
    aliases: tuple[str, ...] = (),
    deprecated_aliases: tuple[str, ...] = (),
    size: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: Sequence[Any] | None = None,
    required: bool = False,
) -> Any:
    """Declare a configuration key.

    Args:
        default: default value (omit together with ``default_factory`` for a required key).
        doc: one sentence saying what the key does; shown by ``doctor`` and in the docs.
        default_factory: factory for mutable defaults (nested sections, lists).
        aliases: other accepted spellings of the key.
        deprecated_aliases: old spellings that still work but log a deprecation warning.
        size: the value is a byte size (``int`` or ``"1.5GB"``-style string).
        minimum: smallest accepted number.
        maximum: largest accepted number.
        choices: the accepted values (for strings this is case-insensitive); a live
            sequence (a registry's view of its names) is read at each check and description.
        required: the key must be given (no default applies).
    """
    meta = {
        "doc": doc,
        "aliases": tuple(aliases),
        "deprecated_aliases": tuple(deprecated_aliases),
        "size": size,
        "minimum": minimum,
        "maximum": maximum,
        "choices": choices,
        "required": required,
    }
    if size and isinstance(default, str):
        default = parse_size(default, key="default", source="option()")
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    if default is dataclasses.MISSING:
        required = True
        meta["required"] = True
        return dataclasses.field(default=None, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class OptionDoc:
    """Documentation of one key, as rendered by the docs and ``doctor``."""

    key: str
    type: str
    default: str
    doc: str
    aliases: tuple[str, ...] = ()
    deprecated_aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class ConfigSection:
    """Base of every typed configuration section.

    Subclasses are frozen dataclasses whose fields are declared with :func:`option`.
    Class attribute ``passthrough_keys`` lists keys that belong to someone else
    (vLLM, another connector in a ``MultiConnector``) and are accepted silently.
    """

    passthrough_keys: ClassVar[frozenset[str]] = frozenset()

    # ------------------------------------------------------------------ parse
    @classmethod
    def from_dict(
        cls: type[T],
        data: Mapping[str, Any] | None,
        *,
        source: str = "kv_connector_extra_config",
        strict: bool = False,
        defaults: T | None = None,
    ) -> T:
        """Build a validated section from a mapping.

        Args:
            data: the raw mapping (``None`` means empty).
            source: where the mapping came from, used as the prefix of every error.
            strict: raise on unknown keys instead of logging a warning.
            defaults: where the keys ``data`` leaves out take their values (``None``: the
                class's defaults). A nested section's keys default to the field's own
                default (its ``default_factory``), so one section type can serve several
                keys with different defaults.

        Raises:
            ConfigError: on a missing required key, a wrong type, a value out of range,
                or (``strict``) an unknown key.
        """
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"{source}: expected a mapping (JSON object), got {data!r} ({type(data).__name__})",
                key=source, value=data, source=source)
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        consumed: set[str] = set()
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            meta = f.metadata
            found_key, raw = _lookup(data, f.name, meta, source)
            if found_key is None:
                if defaults is not None:
                    values[f.name] = getattr(defaults, f.name)
                elif meta.get("required"):
                    raise ConfigError(
                        f"{source}: required key {f.name!r} is missing ({meta.get('doc', '')})",
                        key=f"{source}.{f.name}", source=source)
                continue
            consumed.add(found_key)
            nested_default = (getattr(defaults, f.name) if defaults is not None
                              else _field_default(f))
            values[f.name] = _convert(raw, hints[f.name], meta, key=found_key, source=source,
                                      nested_default=nested_default)
        unknown = [k for k in data if k not in consumed and k not in cls.passthrough_keys]
        unknown = [k for k in unknown if k not in cls._all_key_names()]
        if unknown:
            msg = cls._unknown_message(unknown, source)
            if strict:
                raise ConfigError(msg, key=unknown[0], value=data[unknown[0]], source=source)
            logger.warning("%s", msg)
        try:
            section = cls(**values)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {exc}", source=source) from exc
        section.validate(source)
        return section

    def validate(self, source: str) -> None:
        """Cross-field checks; subclasses override and raise :class:`ConfigError`."""

    @classmethod
    def unknown_keys(cls, data: Mapping[str, Any] | None) -> list[str]:
        """Keys of ``data`` this section does not read (for ``doctor``)."""
        if not data:
            return []
        names = cls._all_key_names() | cls.passthrough_keys
        return [k for k in data if k not in names]

    @classmethod
    def _all_key_names(cls) -> set[str]:
        names: set[str] = set()
        for f in dataclasses.fields(cls):
            names.add(f.name)
            names.update(f.metadata.get("aliases", ()))
            names.update(f.metadata.get("deprecated_aliases", ()))
        return names

    @classmethod
    def _unknown_message(cls, unknown: list[str], source: str) -> str:
        parts = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(cls._all_key_names()), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            parts.append(f"{key!r}{hint}")
        return (f"{source}: unknown key(s) {', '.join(parts)} for {cls.__name__}; "
                f"accepted keys: {', '.join(sorted(f.name for f in dataclasses.fields(cls)))}")

    # ------------------------------------------------------------------ describe
    @classmethod
    def describe(cls, prefix: str = "", defaults: ConfigSection | None = None
                 ) -> Iterator[OptionDoc]:
        """Yield the documentation of every key, nested sections flattened with dots (their
        defaults those of the field's own default, see :meth:`from_dict`).

        Args:
            prefix: put before every key (a nested section's dotted path).
            defaults: the defaults to show (``None``: the class's).
        """
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            tp = hints[f.name]
            nested = _section_type(tp)
            key = f"{prefix}{f.name}"
            default = getattr(defaults, f.name) if defaults is not None else _field_default(f)
            if nested is not None:
                yield OptionDoc(key, "object", "{}", f.metadata.get("doc", ""),
                                f.metadata.get("aliases", ()), f.metadata.get("deprecated_aliases", ()))
                yield from nested.describe(prefix=f"{key}.", defaults=default)
                continue
            yield OptionDoc(
                key=key,
                type=_type_name(tp, f.metadata),
                default=_default_text(f, default),
                doc=f.metadata.get("doc", ""),
                aliases=f.metadata.get("aliases", ()),
                deprecated_aliases=f.metadata.get("deprecated_aliases", ()),
            )

    def to_dict(self) -> dict[str, Any]:
        """The section as plain JSON-able data."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------- helpers
def _lookup(data: Mapping[str, Any], name: str, meta: Mapping[str, Any],
            source: str) -> tuple[str | None, Any]:
    if name in data:
        return name, data[name]
    for alias in meta.get("aliases", ()):
        if alias in data:
            return alias, data[alias]
    for alias in meta.get("deprecated_aliases", ()):
        if alias in data:
            logger.warning("%s: key %r is deprecated, use %r instead", source, alias, name)
            return alias, data[alias]
    return None, None


def _section_type(tp: Any) -> type[ConfigSection] | None:
    if isinstance(tp, type) and issubclass(tp, ConfigSection):
        return tp
    return None


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != len(get_args(tp)):
            inner = args[0] if len(args) == 1 else Union[tuple(args)]  # noqa: UP007
            return True, inner
    return False, tp


def _fail(key: str, source: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(
        f"{source}: {key}: expected {expected}, got {value!r} ({type(value).__name__})",
        key=key, value=value, source=source)


def _convert(value: Any, tp: Any, meta: Mapping[str, Any], *, key: str, source: str,
             nested_default: Any = None) -> Any:
    optional, inner = _is_optional(tp)
    if value is None:
        if optional:
            return None
        raise _fail(key, source, value, f"a value of type {_type_name(tp, meta)}")
    tp = inner
    nested = _section_type(tp)
    if nested is not None:
        if not isinstance(value, Mapping):
            raise _fail(key, source, value, "an object")
        return nested.from_dict(value, source=f"{source}.{key}",
                                defaults=nested_default if isinstance(nested_default, nested)
                                else None)
    if meta.get("size"):
        return _check_range(parse_size(value, key=key, source=source), meta, key, source)
    origin = get_origin(tp)
    if origin is Literal:
        return _choice(value, get_args(tp), key, source)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise _fail(key, source, value, "a bool (true or false)")
    if tp is int:
        if isinstance(value, bool):
            raise _fail(key, source, value, "an integer")
        if isinstance(value, int):
            out = value
        elif isinstance(value, float) and value.is_integer():
            out = int(value)
        elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
            out = int(value.strip())
        else:
            raise _fail(key, source, value, "an integer")
        return _check_range(out, meta, key, source)
    if tp is float:
        if isinstance(value, bool):
            raise _fail(key, source, value, "a number")
        if isinstance(value, (int, float)):
            out_f = float(value)
        elif isinstance(value, str):
            try:
                out_f = float(value)
            except ValueError:
                raise _fail(key, source, value, "a number") from None
        else:
            raise _fail(key, source, value, "a number")
        if not math.isfinite(out_f):
            # NaN passes every range check and never compares true (a lease that never
            # lapses); infinity overflows the waits and clocks that use it
            raise ConfigError(f"{source}: {key}: must be finite, got {value!r}",
                              key=key, value=value, source=source)
        return _check_range(out_f, meta, key, source)
    if tp is str:
        if not isinstance(value, str):
            raise _fail(key, source, value, "a string")
        if meta.get("choices"):
            return _choice(value, meta["choices"], key, source)
        return value
    if origin in (list, tuple):
        (item_tp, *_rest) = get_args(tp) or (Any,)
        if isinstance(value, str) and item_tp is int:
            # upstream writes pp_layer_partition as "a,b,c"
            value = [v for v in value.replace(" ", "").split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise _fail(key, source, value, f"a list of {_type_name(item_tp, {})}")
        items = [_convert(v, item_tp, {}, key=f"{key}[{i}]", source=source)
                 for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _fail(key, source, value, "an object")
        return dict(value)
    if tp is Any:
        return value
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def _choice(value: Any, choices: Sequence[Any], key: str, source: str) -> Any:
    for c in choices:
        if value == c or (isinstance(value, str) and isinstance(c, str) and value.lower() == c.lower()):
            return c
    raise _fail(key, source, value, "one of " + ", ".join(repr(c) for c in choices))


def _check_range(value: Any, meta: Mapping[str, Any], key: str, source: str) -> Any:
    lo, hi = meta.get("minimum"), meta.get("maximum")
    if lo is not None and value < lo:
        raise ConfigError(f"{source}: {key}: must be >= {lo}, got {value!r}",
                          key=key, value=value, source=source)
    if hi is not None and value > hi:
        raise ConfigError(f"{source}: {key}: must be <= {hi}, got {value!r}",
                          key=key, value=value, source=source)
    choices = meta.get("choices")
    if choices and value not in choices:
        raise _fail(key, source, value, "one of " + ", ".join(repr(c) for c in choices))
    return value


def _type_name(tp: Any, meta: Mapping[str, Any]) -> str:
    optional, inner = _is_optional(tp)
    if meta.get("size"):
        name = "size (int bytes or '1.5GB')"
    elif get_origin(inner) is Literal:
        name = " | ".join(repr(a) for a in get_args(inner))
    elif get_origin(inner) in (list, tuple):
        args = get_args(inner)
        name = f"list[{_type_name(args[0], {}) if args else 'any'}]"
    elif get_origin(inner) is dict or inner is dict:
        name = "object"
    elif isinstance(inner, type):
        name = inner.__name__
    else:
        name = str(inner)
    if meta.get("choices") and inner is str:
        name = " | ".join(repr(c) for c in meta["choices"])
    return f"{name} | null" if optional else name


def _field_default(f: dataclasses.Field[Any]) -> Any:
    """A field's default value (a new one from its ``default_factory``)."""
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def _default_text(f: dataclasses.Field[Any], value: Any) -> str:
    if f.metadata.get("required"):
        return "(required)"
    if f.metadata.get("size") and isinstance(value, int):
        return format_size(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)
