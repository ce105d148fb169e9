"""What counts as a read of global process-group state, and the allowlist's settings.

The settings are those of ``[tool.pgregistry.allowlist]``.

Two families of accessors are recognised. The *legacy* family is Megatron-style ``parallel_state``:
a module matches when its dotted path equals a configured name or ends with ``.<name>`` (so
``parallel_state`` covers ``megatron.core.parallel_state`` however it is imported or aliased), and
``aliases`` are bare names taken for the module when no import in the file binds them (``ps`` in
Megatron-LM's own checker). The *registry* family is pgregistry's own global grid. Shims
(``use_mpu_process_groups``) count wherever they are called or referenced. The defaults reproduce
the accessor rule of Megatron-LM's checker (Megatron-LM pull request 6258) and add the module-level
globals (``parallel_state._TENSOR_MODEL_PARALLEL_GROUP``) and the gloo getters that rule misses.

Everything here is plain data: the scanner needs it picklable and hashable, and the cache keys on
it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_ALLOWLIST",
    "DEFAULT_EXCLUDE",
    "PRESETS",
    "ConfigError",
    "ScanConfig",
    "Settings",
    "find_config_file",
    "load_settings",
    "preset_config",
    "read_toml",
]

#: Bump whenever the scanner's output for the same input could change: it is part of every cache
#: key.
SCANNER_VERSION = 3

DEFAULT_ALLOWLIST = "process_group_usage_allowlist.json"
DEFAULT_EXCLUDE: tuple[str, ...] = (
    ".*",
    "__pycache__",
    "*.egg-info",
    "build",
    "dist",
    "node_modules",
)

_TABLE = ("tool", "pgregistry", "allowlist")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*\Z")
_PATTERN = re.compile(r"[\w*?\[\]!]+\Z")


class ConfigError(ValueError):
    """A bad setting, in ``pyproject.toml`` or on the command line; the message names it."""


@dataclass(frozen=True)
class ScanConfig:
    """Which names the scanner reports.

    Patterns are :mod:`fnmatch` patterns, matched case-sensitively.
    """

    modules: tuple[str, ...] = ("parallel_state", "mpu")
    aliases: tuple[str, ...] = ("ps",)
    accessors: tuple[str, ...] = (
        "get_*_group",
        "get_*_groups",
        "get_*_rank",
        "get_*_world_size",
        "get_*_src_rank",
        "get_*_group_gloo",
        "get_*_groups_gloo",
        "_*_GROUP",
        "_*_GROUPS",
        "_*_GROUP_GLOO",
        "_*_RANK",
        "_*_RANKS",
        "_*_WORLD_SIZE",
    )
    ignore_accessors: tuple[str, ...] = ("get_virtual_pipeline_*", "_VIRTUAL_PIPELINE_*")
    registry_modules: tuple[str, ...] = ("pgregistry.global_grid", "pgregistry")
    registry_accessors: tuple[str, ...] = ("global_collection*", "get_global_*")
    shims: tuple[str, ...] = ("use_mpu_process_groups",)
    #: Qualified functions that read the global grid when an argument is None
    #: (``megatron.core.utils.get_tensor_model_parallel_group_if_none``): each call is a site.
    fallback_helpers: tuple[str, ...] = ()
    #: Modules that implement the global state (``megatron.core.parallel_state``): their reads are
    #: the implementation, not uses, and are not reported. Matched like ``modules``, against the
    #: file's module name.
    exempt_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            kind = _FIELD_KINDS[field.name]
            for value in getattr(self, field.name):
                if not kind[0].match(value):
                    raise ConfigError(f"{_toml_key(field.name)}: {value!r} is not {kind[1]}")

    def fingerprint(self) -> str:
        """A digest of every setting that changes what the scanner reports.

        The scanner version, the running Python's version (it decides which syntax parses) and every
        such setting go into it."""
        payload = json.dumps(
            [SCANNER_VERSION, sys.version_info[:2], dataclasses.asdict(self)], sort_keys=True
        )
        return hashlib.blake2b(payload.encode(), digest_size=12).hexdigest()


_FIELD_KINDS: dict[str, tuple[re.Pattern[str], str]] = {
    "modules": (_DOTTED, "a dotted module name"),
    "aliases": (_IDENTIFIER, "an identifier"),
    "accessors": (_PATTERN, "an accessor name pattern"),
    "ignore_accessors": (_PATTERN, "an accessor name pattern"),
    "registry_modules": (_DOTTED, "a dotted module name"),
    "registry_accessors": (_PATTERN, "an accessor name pattern"),
    "shims": (_IDENTIFIER, "an identifier"),
    "fallback_helpers": (_DOTTED, "a dotted function name (module.function)"),
    "exempt_modules": (_DOTTED, "a dotted module name"),
}

#: Built-in settings for a known code base, chosen with ``--preset`` or ``preset = "..."``; keys
#: given in the table override the preset's.
PRESETS: dict[str, ScanConfig] = {
    # Megatron-LM and its users (Megatron-Bridge, NeMo RL). Module names are qualified, so another
    # project's ``parallel_state`` (``vllm.distributed.parallel_state``) is not reported.
    "megatron": ScanConfig(
        modules=("megatron.core.parallel_state", "megatron.core.mpu"),
        aliases=("ps",),
        accessors=(
            *ScanConfig().accessors,
            "get_*_global_ranks",
            "get_all_ranks",
            "is_pipeline_first_stage",
            "is_pipeline_last_stage",
            "is_rank_in_*",
            "_*_WITH_*",
        ),
        fallback_helpers=("megatron.core.utils.get_tensor_model_parallel_group_if_none",),
        exempt_modules=("megatron.core.parallel_state", "megatron.core.process_groups_config"),
    ),
}


@dataclass(frozen=True)
class Settings:
    """One run's settings: the project root every reported path is relative to, and what to scan."""

    root: Path
    roots: tuple[str, ...] = (".",)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    allowlist: Path = Path(DEFAULT_ALLOWLIST)
    cache_dir: Path | None = Path(".pgregistry_cache")
    scan: ScanConfig = ScanConfig()

    def resolve(self, path: Path) -> Path:
        """``path`` made absolute against the project root (absolute paths are kept)."""
        return path if path.is_absolute() else self.root / path


def _toml_key(name: str) -> str:
    return name.replace("_", "-")


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML file at ``path`` (a ``pyproject.toml``, a ``ruff.toml``), read.

    ``ConfigError`` naming it when it cannot be read or parsed, or when this Python has no TOML
    reader."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]
        except ModuleNotFoundError:
            raise ConfigError(
                f"reading {path} needs tomllib (Python 3.11+) or the tomli package: `pip "
                "install tomli`, or pass --isolated and give the settings on the command line"
            ) from None
    try:
        with path.open("rb") as handle:
            data: dict[str, Any] = tomllib.load(handle)
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from None
    except UnicodeDecodeError as error:  # TOML is UTF-8; tomllib lets the decoder's error through
        raise ConfigError(f"{path} is not valid TOML: not UTF-8 ({error})") from None
    return data


def _allowlist_table(data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    node: Any = data
    for part in _TABLE:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    if not isinstance(node, Mapping):
        raise ConfigError("[tool.pgregistry.allowlist] must be a table")
    return node


def find_config_file(start: Path) -> Path | None:
    """The nearest ``pyproject.toml`` at or above ``start`` with a pgregistry allowlist table.

    That is, a ``[tool.pgregistry.allowlist]`` table.
    """
    for directory in (start, *start.parents):
        candidate = directory / "pyproject.toml"
        if candidate.is_file() and _allowlist_table(read_toml(candidate)) is not None:
            return candidate
    return None


def _string_list(table: Mapping[str, Any], key: str, where: Path) -> tuple[str, ...]:
    value = table[key]
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ConfigError(
            f"{where}: [tool.pgregistry.allowlist] {key} must be a list of non-empty strings"
        )
    return tuple(value)


def _nonempty_string(table: Mapping[str, Any], key: str, where: Path) -> str:
    value = table[key]
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: [tool.pgregistry.allowlist] {key} must be a non-empty string")
    return value


_SCAN_KEYS = {_toml_key(field.name): field.name for field in dataclasses.fields(ScanConfig)}
_LIST_KEYS = {"roots", "exclude", "extend-exclude"}
_NAME_KEYS = {"preset"}


def preset_config(name: str, where: str) -> ScanConfig:
    """The built-in :data:`PRESETS` entry ``name``; ``where`` names the setting in the error."""
    if name not in PRESETS:
        raise ConfigError(f"{where}: unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return PRESETS[name]


_PATH_KEYS = {"allowlist", "cache-dir"}


def load_settings(config_file: Path | None, cwd: Path) -> Settings:
    """Settings from ``config_file``'s ``[tool.pgregistry.allowlist]`` table.

    Its directory is the project root; when ``config_file`` is None, the defaults rooted at ``cwd``.
    Unknown keys are errors, so a typo never silently widens or narrows the scan."""
    if config_file is None:
        return Settings(root=cwd)
    config_file = config_file.resolve()
    table = _allowlist_table(read_toml(config_file)) or {}
    unknown = sorted(set(table) - set(_SCAN_KEYS) - _LIST_KEYS - _NAME_KEYS - _PATH_KEYS)
    if unknown:
        known = ", ".join(sorted({*_SCAN_KEYS, *_LIST_KEYS, *_NAME_KEYS, *_PATH_KEYS}))
        raise ConfigError(
            f"{config_file}: unknown key(s) in [tool.pgregistry.allowlist]: {', '.join(unknown)} "
            f"(known: {known})"
        )
    base = ScanConfig()
    if "preset" in table:
        where = f"{config_file}: [tool.pgregistry.allowlist] preset"
        base = preset_config(_nonempty_string(table, "preset", config_file), where)
    scan = dataclasses.replace(
        base,
        **{
            _SCAN_KEYS[key]: _string_list(table, key, config_file)
            for key in table
            if key in _SCAN_KEYS
        },
    )
    settings = Settings(root=config_file.parent, scan=scan)
    if "roots" in table:
        settings = dataclasses.replace(settings, roots=_string_list(table, "roots", config_file))
    if "exclude" in table:
        settings = dataclasses.replace(
            settings, exclude=_string_list(table, "exclude", config_file)
        )
    if "extend-exclude" in table:
        extra = _string_list(table, "extend-exclude", config_file)
        settings = dataclasses.replace(settings, exclude=settings.exclude + extra)
    if "allowlist" in table:
        settings = dataclasses.replace(
            settings, allowlist=Path(_nonempty_string(table, "allowlist", config_file))
        )
    if "cache-dir" in table:
        settings = dataclasses.replace(
            settings, cache_dir=Path(_nonempty_string(table, "cache-dir", config_file))
        )
    return settings
