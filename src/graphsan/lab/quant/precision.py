"""Per-module precision: a base recipe, ordered glob rules on module paths, first/last N layers in BF16.

A precision file (YAML):

    base: nvfp4                      # a recipe name, a name from `recipes`, or an inline mapping
    recipes:                         # optional named recipe configs
      nvfp4-legacy: {kind: nvfp4, order: legacy, rht: false}
    rules:                           # ordered glob matchers on module paths; first match wins
      - {match: "*.linear_qkv", recipe: bf16}
      - {match: "*mixer.out_proj", recipe: mxfp8}
    first_bf16: 0                    # optional: the first / last N layers run in BF16
    last_bf16: 0

Module paths are `model.named_modules()` names, e.g. `layers.7.mixer.out_proj`; globs use
`fnmatch` rules (`*` also matches dots). The layer index of a path is the number after its first
`layers.` component; paths under `mtp` are never counted as layers. First/last-N-BF16 wins over the
rules (the whole layer runs in BF16), rules win over the base.

Built-in files, loaded by name (`PrecisionConfig.from_yaml("super-mixed")`) or by path:
`super-mixed` (the TE #3316 mix), `mxfp8-all`, `mxfp8-base-nvfp4-outproj`.

    cfg = PrecisionConfig.from_yaml("super-mixed")
    table = apply_precision(model, cfg, layer_pattern="M*M-ME", last_bf16=2)
    print(format_precision_table(table))
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from .recipe import KINDS, OPTIONS, Recipe, RecipeError, get_recipe

CONFIG_DIR = Path(__file__).parent / "configs"
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_GLOB_CHARS = re.compile(r"^[A-Za-z0-9_.*?\[\]!\-]+$")
_TOP_KEYS = ("base", "recipes", "rules", "first_bf16", "last_bf16")
# Separators allowed in a hybrid layer pattern string (Megatron uses "|" between pipeline stages).
_PATTERN_SEPARATORS = "| \t"


class PrecisionConfigError(ValueError):
    """A precision file or argument that is wrong: names the file, the key and what was expected."""


@dataclass(frozen=True)
class Rule:
    """One glob matcher: modules whose path matches `pattern` run `recipe` (named `name`)."""

    pattern: str
    recipe: Recipe
    name: str

    def matches(self, path: str) -> bool:
        return fnmatch.fnmatchcase(path, self.pattern)


@dataclass
class PrecisionConfig:
    """A base recipe, ordered rules (first match wins) and first/last N layers in BF16."""

    base: Recipe
    rules: list[Rule] = field(default_factory=list)
    first_bf16: int = 0
    last_bf16: int = 0
    source: str = "<inline>"

    @classmethod
    def from_yaml(cls, path: str | Path, base: Recipe | str | None = None) -> PrecisionConfig:
        """Load a precision file by path, or a built-in one by name; `base` overrides its base."""
        file = resolve_config(path)
        try:
            data = yaml.safe_load(file.read_text())
        except yaml.YAMLError as e:
            raise PrecisionConfigError(f"{file}: malformed YAML{_yaml_problem(e)}") from None
        except RecursionError:
            raise PrecisionConfigError(
                f"{file}: malformed YAML: nested deeper than the YAML reader follows; expected "
                f"a mapping with keys {list(_TOP_KEYS)}"
            ) from None
        return cls.from_dict(data, source=str(file), base=base)

    @classmethod
    def from_dict(
        cls, data, source: str = "<dict>", base: Recipe | str | None = None
    ) -> PrecisionConfig:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise PrecisionConfigError(
                f"{source}: top level is a {type(data).__name__}; expected a mapping with keys {list(_TOP_KEYS)}"
            )
        for key in data:
            if key not in _TOP_KEYS:
                raise PrecisionConfigError(
                    f"{source}: unknown key {key!r}; expected one of {list(_TOP_KEYS)}"
                )
        named = _parse_named_recipes(data.get("recipes") or {}, source)
        if base is None:
            if "base" not in data:
                raise PrecisionConfigError(
                    f"{source}: key 'base' is missing; expected a recipe name ({_names(named)}) or a mapping"
                )
            base_recipe = _parse_recipe(data["base"], named, source, "base")
        elif isinstance(base, Recipe):
            base_recipe = base
        else:
            base_recipe = _parse_recipe(base, named, source, "base (argument)")
        rules = _parse_rules(data.get("rules"), named, source)
        first = _parse_count(data.get("first_bf16", 0), source, "first_bf16")
        last = _parse_count(data.get("last_bf16", 0), source, "last_bf16")
        return cls(base_recipe, rules, first, last, source)

    @classmethod
    def uniform(cls, recipe: Recipe) -> PrecisionConfig:
        return cls(recipe, source=f"<uniform {recipe.describe()}>")

    def resolve(
        self, path: str, num_layers: int | None, first_bf16: int, last_bf16: int
    ) -> tuple[Recipe, str]:
        """The recipe of the module at `path` and why (for the table)."""
        index = layer_index(path)
        if index is not None and num_layers is not None:
            if index < first_bf16:
                return get_recipe("bf16"), f"first {first_bf16} layers"
            if index >= num_layers - last_bf16:
                return get_recipe("bf16"), f"last {last_bf16} layers"
        for rule in self.rules:
            if rule.matches(path):
                return rule.recipe, f"rule {rule.pattern}"
        return self.base, "base"


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error in one line (its own text spans five, with a caret under the column)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or " ".join(str(err).split())
    return f"{where}: {problem}"


def builtin_configs() -> list[str]:
    """Names of the precision files shipped with the package."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config(path: str | Path) -> Path:
    """A path to an existing file, or a built-in config name."""
    p = Path(path)
    if p.is_file():
        return p
    builtin = CONFIG_DIR / f"{path}.yaml"
    if isinstance(path, str) and "/" not in path and builtin.is_file():
        return builtin
    raise PrecisionConfigError(
        f"{path}: no such precision file; expected a path to a YAML file or one of {builtin_configs()}"
    )


def layer_index(path: str) -> int | None:
    """The decoder layer index of a module path (`layers.{i}.`), None outside layers or in MTP."""
    if "mtp" in path.split("."):
        return None
    m = LAYER_INDEX.search(path)
    return int(m.group(1)) if m else None


def count_layers(layer_pattern, paths: list[str]) -> int | None:
    """Number of layers: from a hybrid pattern string (one symbol per layer, e.g. "M*M-ME";
    "|" separators ignored), an int, or None (one more than the largest index among `paths`)."""
    if isinstance(layer_pattern, bool):
        raise PrecisionConfigError(f"layer_pattern={layer_pattern!r}; expected a str, int or None")
    if isinstance(layer_pattern, int):
        if layer_pattern < 0:
            raise PrecisionConfigError(f"layer_pattern={layer_pattern}; expected >= 0")
        return layer_pattern
    if isinstance(layer_pattern, str):
        return sum(1 for c in layer_pattern if c not in _PATTERN_SEPARATORS)
    if layer_pattern is None:
        indices = [i for i in map(layer_index, paths) if i is not None]
        return max(indices) + 1 if indices else None
    raise PrecisionConfigError(
        f"layer_pattern={layer_pattern!r}; expected a hybrid pattern string, an int or None"
    )


def apply_precision(
    model: torch.nn.Module,
    config: PrecisionConfig | Recipe | str | Path,
    layer_pattern: str | int | None = None,
    first_bf16: int | None = None,
    last_bf16: int | None = None,
) -> list[tuple[str, str]]:
    """Bind a recipe to every quantizable module (anything with `set_recipe`, e.g. QuantLinear).

    config: a PrecisionConfig, a Recipe (everything in it), or a precision file path / built-in
    name. layer_pattern: the hybrid pattern string, the number of layers, or None to use
    `model.layer_pattern` when present, else infer from the module paths. first_bf16 / last_bf16:
    None takes the config's values. Returns [(module path, "recipe description [why]")].
    """
    if isinstance(config, Recipe):
        config = PrecisionConfig.uniform(config)
    elif isinstance(config, (str, Path)):
        config = PrecisionConfig.from_yaml(config)
    elif not isinstance(config, PrecisionConfig):
        raise PrecisionConfigError(
            f"config is a {type(config).__name__}; expected a PrecisionConfig, Recipe, name or path"
        )
    first = (
        config.first_bf16
        if first_bf16 is None
        else _parse_count(first_bf16, "apply_precision", "first_bf16")
    )
    last = (
        config.last_bf16
        if last_bf16 is None
        else _parse_count(last_bf16, "apply_precision", "last_bf16")
    )
    targets = [(p, m) for p, m in model.named_modules() if callable(getattr(m, "set_recipe", None))]
    if layer_pattern is None:
        layer_pattern = getattr(model, "layer_pattern", None)
    num_layers = count_layers(layer_pattern, [p for p, _ in targets])
    if (first or last) and num_layers is None:
        raise PrecisionConfigError(
            "first_bf16/last_bf16 given but no layers found; expected module paths like "
            "'layers.{i}.…' or a layer_pattern"
        )
    table = []
    for path, module in targets:
        recipe, why = config.resolve(path, num_layers, first, last)
        module.set_recipe(recipe)
        table.append((path, f"{recipe.describe()} [{why}]"))
    return table


def format_precision_table(table: list[tuple[str, str]]) -> str:
    """The table of `apply_precision` as aligned text."""
    width = max((len(p) for p, _ in table), default=6)
    lines = [f"{'module':<{width}}  recipe", f"{'-' * width}  ------"]
    lines += [f"{p:<{width}}  {d}" for p, d in table]
    return "\n".join(lines)


# --- parsing helpers ------------------------------------------------------------------------


def _names(named: dict) -> str:
    return ", ".join(list(KINDS) + sorted(named))


def _parse_named_recipes(data, source: str) -> dict[str, Recipe]:
    if not isinstance(data, dict):
        raise PrecisionConfigError(
            f"{source}: key 'recipes' is a {type(data).__name__}; expected a mapping name -> {{kind: ..., options}}"
        )
    named = {}
    for name, spec in data.items():
        if not isinstance(name, str) or name in KINDS:
            raise PrecisionConfigError(
                f"{source}: key 'recipes.{name}': expected a new name (not one of {list(KINDS)})"
            )
        if not isinstance(spec, dict):
            raise PrecisionConfigError(
                f"{source}: key 'recipes.{name}' is {spec!r}; expected a mapping {{kind: ..., options}}"
            )
        named[name] = _parse_recipe(spec, {}, source, f"recipes.{name}")
    return named


def _parse_recipe(spec, named: dict[str, Recipe], source: str, key: str) -> Recipe:
    if isinstance(spec, str):
        if spec in named:
            return named[spec]
        if spec in KINDS:
            return get_recipe(spec)
        raise PrecisionConfigError(
            f"{source}: key '{key}': unknown recipe {spec!r}; expected one of {_names(named)}"
        )
    if isinstance(spec, dict):
        spec = dict(spec)
        kind = spec.pop("kind", None)
        if kind not in KINDS:
            raise PrecisionConfigError(
                f"{source}: key '{key}.kind' is {kind!r}; expected one of {list(KINDS)}"
            )
        try:
            return get_recipe(kind, **spec)
        except RecipeError as e:
            raise PrecisionConfigError(
                f"{source}: key '{key}': {e} (options of {kind}: {list(OPTIONS[kind])})"
            ) from None
    raise PrecisionConfigError(
        f"{source}: key '{key}' is {spec!r}; expected a recipe name ({_names(named)}) or a mapping"
    )


def _parse_rules(data, named: dict[str, Recipe], source: str) -> list[Rule]:
    if data is None:
        return []
    if not isinstance(data, list):
        raise PrecisionConfigError(
            f"{source}: key 'rules' is a {type(data).__name__}; expected a list of {{match: GLOB, recipe: NAME}}"
        )
    rules = []
    for i, item in enumerate(data):
        key = f"rules[{i}]"
        if not isinstance(item, dict) or set(item) != {"match", "recipe"}:
            raise PrecisionConfigError(
                f"{source}: key '{key}' is {item!r}; expected a mapping with exactly 'match' and 'recipe'"
            )
        pattern = item["match"]
        _check_glob(pattern, source, f"{key}.match")
        recipe = _parse_recipe(item["recipe"], named, source, f"{key}.recipe")
        name = item["recipe"] if isinstance(item["recipe"], str) else recipe.describe()
        rules.append(Rule(pattern, recipe, name))
    return rules


def _check_glob(pattern, source: str, key: str) -> None:
    expected = "a non-empty glob over module paths (letters, digits, _ . - * ? [...])"
    if not isinstance(pattern, str) or not pattern:
        raise PrecisionConfigError(f"{source}: key '{key}' is {pattern!r}; expected {expected}")
    if not _GLOB_CHARS.match(pattern):
        raise PrecisionConfigError(
            f"{source}: key '{key}' is {pattern!r}: contains characters a module path cannot have; "
            f"expected {expected}"
        )
    depth = 0
    for i, c in enumerate(pattern):
        if c == "[":
            if depth or pattern[i + 1 : i + 2] == "]":
                raise PrecisionConfigError(
                    f"{source}: key '{key}' is {pattern!r}: nested or empty '[...]'; expected {expected}"
                )
            depth = 1
        elif c == "]":
            if not depth:
                raise PrecisionConfigError(
                    f"{source}: key '{key}' is {pattern!r}: ']' without '['; expected {expected}"
                )
            depth = 0
    if depth:
        raise PrecisionConfigError(
            f"{source}: key '{key}' is {pattern!r}: unclosed '['; expected {expected}"
        )


def _parse_count(value, source: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PrecisionConfigError(
            f"{source}: key '{key}' is {value!r}; expected a non-negative integer"
        )
    return value
