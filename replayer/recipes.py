"""Recipes: an intervention saved into the recording under a name, listed by ``pdbg info``,
re-applied by name, carried into bundles.

A recipe is JSON in ``recipes.json`` at the store's root (``{name: recipe}``): the step, the swaps as
import references, the edits as expressions, setting overrides, the seed, and what the replay gave.
It holds code (expressions, references), so it is never applied unless asked for by name.
"""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime
from typing import Any

from recorder.errors import PdbgError
from recorder.store import backend

from .intervene import SETTING_ALIASES
from .recording import Recording, Step

KEY = "recipes.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class RecipeError(PdbgError, ValueError):
    """A recipe that cannot be saved or applied."""


def recipes(rec: Recording) -> dict[str, dict[str, Any]]:
    """The recipes saved in a recording, by name (empty when there are none)."""
    try:
        raw = backend.get(rec.reader.store, KEY)
    except OSError as exc:
        raise RecipeError(f"{rec.reader.label}: {KEY} cannot be read ({exc}); remove it or fix it") from None
    if raw is None:
        return {}
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise RecipeError(f"{rec.reader.label}: {KEY} is not valid JSON; remove it or fix it") from None
    problem = _malformed(doc)
    if problem:
        raise RecipeError(f"{rec.reader.label}: {KEY} {problem}; remove it or fix it")
    return doc


def _malformed(doc: Any) -> str:
    """What keeps ``doc`` from being ``{name: recipe}`` as ``save`` writes it ("" where nothing): a file
    edited by hand or damaged would otherwise fail with a traceback where ``pdbg info`` lists it or a
    replay applies it, or, not an object at all, read as holding no recipes."""
    if not isinstance(doc, dict):
        return f"holds {_a_json(doc)}, not an object of recipes by name"
    for name, recipe in doc.items():
        if not isinstance(recipe, dict):
            return f"holds {_a_json(recipe)} as recipe {name!r}, not a recipe object"
        step = recipe.get("step")
        index = step.get("index") if isinstance(step, dict) else None
        if not isinstance(index, int) or isinstance(index, bool):
            return f"holds recipe {name!r} without a step object whose index is an integer"
        for part, values in (("swap", "import references"), ("edit", "expressions")):
            given = recipe.get(part, {})
            if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
                return f"holds recipe {name!r} whose {part} is not an object of keys and {values}"
        if not isinstance(recipe.get("settings", {}), dict):
            return f"holds recipe {name!r} whose settings is not an object of setting names and values"
        seed = recipe.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            return f"holds recipe {name!r} whose seed is not an integer or null"
    return ""


def _a_json(value: Any) -> str:
    """A JSON value's kind, as a reader of the file names it ("an array", "a number")."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _canonical(settings: Any) -> dict[str, Any]:
    """Setting overrides under the names the recording's settings use (``deterministic`` is
    ``deterministic_algorithms``), as a replay reports them."""
    return {SETTING_ALIASES.get(k, k): v for k, v in settings.items()} if isinstance(settings, dict) else {}


def save(rec: Recording, name: str, step: Step, *, swap: dict[str, Any] | None = None,
         edit: dict[str, Any] | None = None, settings: dict[str, Any] | None = None, seed: int | None = None,
         result: Any = None) -> dict[str, Any]:
    """Save an intervention under ``name`` (replacing one of that name). Swaps must be import
    references and edits expressions: a callable or a tensor cannot be written down as data."""
    check_name(name)
    check_intervention(name, swap, edit, settings, seed)
    for key, value in (swap or {}).items():
        if not isinstance(value, str):
            raise RecipeError(f"recipe {name}: swap {key} must be an import reference ('pkg.mod:Name') to be saved")
    for key, value in (edit or {}).items():
        if not isinstance(value, str):
            raise RecipeError(f"recipe {name}: edit {key} must be an expression in x to be saved")
    check_writable(rec)
    doc = recipes(rec)
    recipe = {"name": name, "step": step.to_json(), "swap": dict(swap or {}), "edit": dict(edit or {}),
              "settings": _canonical(settings), "seed": seed, "saved": datetime.now(UTC).isoformat()}
    if result is not None:
        recipe["result"] = {"match": result.match, "outputs": [
            {"name": d.name, "recorded": d.recorded, "replayed": d.replayed} for d in result.outputs],
            "inner": [{"step": s.step.index, "change": s.change} for s in result.inner],
            "unrecorded_inner": result.unrecorded_inner.to_json() if result.unrecorded_inner else None}
    doc[name] = recipe
    try:
        backend.put(rec.reader.store, KEY, json.dumps(doc, indent=1, allow_nan=False).encode(), durable=True)
    except OSError as exc:
        raise RecipeError(f"cannot save recipe {name!r} in {rec.reader.label} ({exc.strerror or exc}); copy the "
                          "recording somewhere writable to save recipes in it") from None
    return recipe


def check_name(name: Any) -> None:
    """Refuse a name a recipe cannot be saved under, before anything is replayed (an empty one too,
    which would otherwise read as no name given)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise RecipeError(f"recipe name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)")


def check_intervention(name: str, swap: Any, edit: Any, settings: Any, seed: Any) -> None:
    """Refuse, before anything is replayed, a recipe that would hold no intervention: applied, it would
    replay the step as recorded, which needs no recipe."""
    if not (swap or edit or settings or seed is not None):
        raise RecipeError(f"recipe {name}: there is no intervention to save; give a swap, an edit, a setting "
                          "or a seed with it (--swap, --edit, --set, --seed)")


def check_writable(rec: Recording) -> None:
    """Refuse, before anything is replayed, a recording a recipe cannot be saved in: a bundle, a
    remote store, a directory this user cannot write (a colleague's, a read-only mount)."""
    root = backend.local_root(rec.reader.store)
    if root is None:
        raise RecipeError(f"{rec.reader.label} is read-only (a bundle or a remote store); save the recipe in the "
                          "recording it came from")
    if not os.access(root, os.W_OK | os.X_OK):
        raise RecipeError(f"cannot save a recipe in {rec.reader.label}: its directory is not writable (another "
                          "user's, or a read-only disk); copy the recording somewhere writable to save recipes in it")


def get(rec: Recording, name: str) -> dict[str, Any]:
    found = recipes(rec)
    if name not in found:
        have = ", ".join(sorted(found)) or "none"
        raise RecipeError(f"no recipe {name!r} in {rec.reader.label}; recipes there: {have}")
    return found[name]


def describe(recipe: dict[str, Any]) -> str:
    """One line: what a recipe does (its code shown in full, since applying it runs that code)."""
    parts = [f"swap {k}={v}" for k, v in recipe.get("swap", {}).items()]
    parts += [f"edit {k}={v}" for k, v in recipe.get("edit", {}).items()]
    parts += [f"set {k}={v}" for k, v in _canonical(recipe.get("settings")).items()]
    if recipe.get("seed") is not None:
        parts.append(f"seed {recipe['seed']}")
    step = recipe.get("step") or {}
    return f"{recipe.get('name')}: step {step.get('index')} ({step.get('name')}): {'; '.join(parts) or 'no change'}"
