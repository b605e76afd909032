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
    return doc if isinstance(doc, dict) else {}


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
