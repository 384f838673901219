"""Activation bytes predicted from a microbatch's size, fitted to measured bytes.

The executor measures what each forward keeps until its backward
(``TorchStageExecutor.activation_bytes``); an admission that counts bytes needs them BEFORE
the forward runs, for sizes it has not seen. ``ActivationModel`` fits, per virtual stage,

    bytes ~ c_1 * 1 + c_t * tokens + c_tt * tokens**2 + sum_f c_f * f + sum_g c_g * g(features)

by least squares over the observed (features, bytes) pairs: ``f`` ranges over the other
features given (``patches``, ``images``, ...) and ``g`` over extra feature functions. Every
tensor a transformer stage saves is a polynomial of degree <= 2 in the sequence length (the
square term: eager attention's scores and masks), so on CPU, where bytes are exact, the fit
is exact up to rounding once the sizes seen identify it.

When a prediction is a fit, and when it falls back. The fit is the minimum-norm least squares
solution over the columns scaled to unit size (numpy's SVD), which stays defined when
columns are dependent: ``images`` and ``patches`` are proportional when every image has the
same size, ``patches`` is all zeros in text-only data. A prediction is the fit's only when the
query lies in the span of the rows seen (``covers``): then every solution of the least
squares problem gives it the same value, so it does not depend on a direction the data never
moved along. The fallback, the largest bytes per token seen on the stage times the query's
tokens (the largest bytes seen when tokens are unknown or zero), answers instead for a query
outside that span (a first image after text-only data, a new sequence length when two lengths
were seen and the quadratic is unknown), on a stage not yet ``ready`` (fewer distinct sizes
than columns that are not all zero), along a direction the sizes seen barely move along
(ill-conditioned: its singular value below 1e-6 of the largest counts as unknown), and where
the fit comes out negative or non-finite. A prediction is never below 0.

``features_of`` reads the size features of the common microbatch types. The module is pure
(numpy only): a planner, a simulator or a ledger can use it without torch.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import numpy as np
import numpy.typing as npt

from ._check import describe
from ._costs import Microbatch
from ._errors import PlanError

__all__ = ["ActivationModel", "FeatureFn", "features_of"]

FeatureFn = Callable[[Mapping[str, float]], float]
"""An extra feature: ``fn(features) -> value`` from a microbatch's size features (for
instance ``lambda f: f["rows"] * (f["tokens"] / f["rows"]) ** 2``, attention's square term
when a microbatch holds several sequences)."""

_CONST = "1"
_TOKENS = "tokens"
_TOKENS_SQ = "tokens**2"
# An ill-conditioned direction counts as unknown: a singular value of the scaled rows below
# this share of the largest is dropped (sizes 100000 and 100002 do not tell tokens**2 from
# tokens), so predictions along it fall back instead of amplifying rounding ~1e6-fold.
_RANK_RTOL = 1e-6
# A query is covered when it is this close (relative) to the span of the kept directions: a
# query in the span is within ~1e-10 of it (rounding), one outside is off by O(1).
_SPAN_RTOL = 1e-8

_Vec = npt.NDArray[np.float64]


def _real(what: str, value: object) -> float:
    """``value`` as a float if it is a finite real >= 0, else a ``PlanError`` naming ``what``
    (the stage and the feature) and the value."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise PlanError(f"{what} must be a number >= 0, got {describe(value)}")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise PlanError(f"{what} must be a finite number >= 0, got {v}")
    return v


@dataclass(slots=True)
class _StageFit:
    """One stage's observations, its fit (recomputed when asked after a change) and errors."""

    keys: frozenset[str]
    columns: tuple[str, ...]
    rows: deque[tuple[tuple[float, ...], float]]
    errors: deque[float]
    max_bytes: float = 0.0
    max_per_token: float | None = None
    dirty: bool = True
    count: int = 0
    # the fit: column scale, coefficients on the scaled columns, the rows' span basis
    scale: _Vec = field(default_factory=lambda: np.ones(0))
    coef: _Vec = field(default_factory=lambda: np.zeros(0))
    span: _Vec = field(default_factory=lambda: np.zeros((0, 0)))
    is_ready: bool = False

    def refit(self) -> None:
        x = np.array([r for r, _ in self.rows], dtype=np.float64)
        y = np.array([b for _, b in self.rows], dtype=np.float64)
        nonzero = int(np.count_nonzero(np.abs(x).max(axis=0)))
        self.is_ready = len({r for r, _ in self.rows}) >= nonzero
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        xs = x / scale
        u, s, vt = np.linalg.svd(xs, full_matrices=False)
        rank = int(np.count_nonzero(s > s[0] * _RANK_RTOL)) if s.size and s[0] > 0 else 0
        self.scale = scale
        self.span = vt[:rank]
        self.coef = vt[:rank].T @ ((u[:, :rank].T @ y) / s[:rank])
        self.dirty = False

    def fit_of(self, row: tuple[float, ...]) -> float | None:
        """The fit's prediction for ``row``, None where the fit does not cover it."""
        if self.dirty:
            self.refit()
        if not self.is_ready:
            return None
        xs = np.asarray(row, dtype=np.float64) / self.scale
        norm = float(np.linalg.norm(xs))
        off = xs - self.span.T @ (self.span @ xs)
        if norm > 0 and float(np.linalg.norm(off)) > _SPAN_RTOL * norm:
            return None
        pred = float(xs @ self.coef)
        return pred if math.isfinite(pred) and pred >= 0 else None

    def fit_many(self, rows: list[tuple[float, ...]]) -> list[float | None]:
        """``fit_of`` of each row, in one pass (a step's microbatches)."""
        if self.dirty:
            self.refit()
        if not self.is_ready or not rows:
            return [None] * len(rows)
        xs = np.asarray(rows, dtype=np.float64) / self.scale
        norms = np.linalg.norm(xs, axis=1)
        offs = np.linalg.norm(xs - (xs @ self.span.T) @ self.span, axis=1)
        preds = xs @ self.coef
        out: list[float | None] = []
        for norm, off, pred in zip(norms.tolist(), offs.tolist(), preds.tolist(), strict=True):
            covered = not (norm > 0 and off > _SPAN_RTOL * norm)
            out.append(pred if covered and math.isfinite(pred) and pred >= 0 else None)
        return out

    def fallback(self, tokens: float | None) -> float:
        if tokens and self.max_per_token is not None:
            return self.max_per_token * tokens
        return self.max_bytes


class ActivationModel:
    """Per virtual stage, activation bytes as a linear model of a microbatch's size.

    Observe measured bytes (``observe``), predict them for a size (``predict``), see whether
    the fit is usable (``ready``, ``covers``) and how far off it was (``error``). The columns
    of a stage are fixed by its first observation: the constant, ``tokens`` and
    ``tokens**2`` when ``tokens`` is a feature, every other feature given (linear), then the
    extra feature functions. See the module note for when a prediction falls back.

    Args:
        extra_features: Name -> function of the features, added as columns (see
            ``FeatureFn``); a function that raises is reported as a ``PlanError``.
        quadratic: Include ``tokens**2`` (attention's scores; False for a model whose
            attention saves O(tokens), if the data cannot tell).
        window: The most recent observations kept per stage (the fit's data).
        error_window: The most recent out-of-sample errors ``error`` reads.

    Raises:
        PlanError: ``window`` < 1 or ``error_window`` < 1, an extra feature named like a
            built-in column or not callable.
    """

    def __init__(
        self,
        *,
        extra_features: Mapping[str, FeatureFn] | None = None,
        quadratic: bool = True,
        window: int = 1024,
        error_window: int = 16,
    ) -> None:
        for name, v in (("window", window), ("error_window", error_window)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"ActivationModel {name} must be an int >= 1, got {describe(v)}")
        extra = dict(extra_features or {})
        for name, fn in extra.items():
            if not isinstance(name, str) or name in (_CONST, _TOKENS, _TOKENS_SQ):
                raise PlanError(
                    f"ActivationModel: extra feature name {name!r} must be a str other than"
                    f" {_CONST!r}, {_TOKENS!r}, {_TOKENS_SQ!r}"
                )
            if not callable(fn):
                raise PlanError(f"ActivationModel: extra feature {name!r} is not callable")
        self._extra = extra
        self._quadratic = bool(quadratic)
        self._window = window
        self._error_window = error_window
        self._stages: dict[int, _StageFit] = {}

    # ------------------------------------------------------------------ input, checked

    def _features(self, stage: int, features: Mapping[str, float]) -> dict[str, float]:
        if not isinstance(features, Mapping):
            raise PlanError(
                f"ActivationModel stage {stage}: features must be a mapping of name -> number"
                f" (features_of(microbatch)), got {describe(features)}"
            )
        out: dict[str, float] = {}
        for k, v in features.items():
            if not isinstance(k, str):
                raise PlanError(f"ActivationModel stage {stage}: feature name {k!r} is no str")
            if k in self._extra:
                raise PlanError(
                    f"ActivationModel stage {stage}: feature {k!r} is also the name of an"
                    " extra feature"
                )
            out[k] = _real(f"ActivationModel stage {stage}: feature {k!r}", v)
        return out

    def _row(self, stage: int, fit: _StageFit, feats: dict[str, float]) -> tuple[float, ...]:
        if feats.keys() != fit.keys:
            missing, extra = sorted(fit.keys - feats.keys()), sorted(feats.keys() - fit.keys)
            raise PlanError(
                f"ActivationModel stage {stage}: the features must be those of the stage's"
                f" first observation ({sorted(fit.keys)}); missing {missing}, unknown {extra}"
            )
        row: list[float] = []
        for col in fit.columns:
            if col == _CONST:
                row.append(1.0)
            elif col == _TOKENS_SQ:
                row.append(feats[_TOKENS] ** 2)
            elif col in feats:
                row.append(feats[col])
            else:
                row.append(self._extra_value(stage, col, feats))
        return tuple(row)

    def _extra_value(self, stage: int, name: str, feats: dict[str, float]) -> float:
        try:
            v = self._extra[name](dict(feats))
        except Exception as e:
            raise PlanError(
                f"ActivationModel stage {stage}: extra feature {name!r} failed on {feats}: {e!r}"
            ) from e
        return _real(f"ActivationModel stage {stage}: extra feature {name!r} (of {feats})", v)

    def _new_fit(self, feats: dict[str, float]) -> _StageFit:
        cols = [_CONST]
        if _TOKENS in feats:
            cols += [_TOKENS, _TOKENS_SQ] if self._quadratic else [_TOKENS]
        cols += sorted(k for k in feats if k != _TOKENS)
        cols += list(self._extra)
        return _StageFit(
            keys=frozenset(feats),
            columns=tuple(cols),
            rows=deque(maxlen=self._window),
            errors=deque(maxlen=self._error_window),
        )

    @staticmethod
    def _stage(stage: object) -> int:
        if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
            raise PlanError(f"ActivationModel: stage must be an int >= 0, got {describe(stage)}")
        return stage

    def _fit(self, stage: int) -> _StageFit:
        fit = self._stages.get(stage)
        if fit is None:
            raise PlanError(
                f"ActivationModel stage {stage}: nothing observed yet (observe() a measured"
                " forward first)"
            )
        return fit

    # ------------------------------------------------------------------ the API

    def observe(self, stage: int, features: Mapping[str, float], measured_bytes: float) -> None:
        """Add a measured forward: ``measured_bytes`` for a microbatch of ``features`` on
        ``stage``. When the stage was ready, what ``predict`` would have said first is
        compared with the measurement (``error``).

        Args:
            stage: The virtual stage.
            features: The microbatch's size features (``features_of``).
            measured_bytes: The bytes measured (``TorchStageExecutor.activation_bytes``).

        Raises:
            PlanError: A bad stage, a feature or ``measured_bytes`` that is no finite number
                >= 0 (the message names the stage, the feature and the value), features other
                than those of the stage's first observation, an extra feature that fails.
        """
        self.observe_many(stage, [(features, measured_bytes)])

    def observe_many(
        self, stage: int, observations: Sequence[tuple[Mapping[str, float], float]]
    ) -> None:
        """Add several measured forwards of ``stage`` at once (a step's): as ``observe``
        each, but each compared (``error``) with the fit of the observations made before
        this call, and the fit recomputed once (not once per observation).

        Raises:
            PlanError: As ``observe``; nothing is added then.
        """
        stage = self._stage(stage)
        checked = [
            (
                self._features(stage, f),
                _real(f"ActivationModel stage {stage}: measured_bytes", y),
            )
            for f, y in observations
        ]
        if not checked:
            return
        fit = self._stages.get(stage)
        if fit is None:
            fit = self._stages[stage] = self._new_fit(checked[0][0])
        rows = [self._row(stage, fit, feats) for feats, _ in checked]
        if fit.count:
            fits = fit.fit_many(rows)
            if fit.is_ready:
                for (feats, y), got in zip(checked, fits, strict=True):
                    pred = got if got is not None else fit.fallback(feats.get(_TOKENS))
                    fit.errors.append(abs(pred - y) / max(y, 1.0))
        for row, (feats, y) in zip(rows, checked, strict=True):
            fit.rows.append((row, y))
            fit.count += 1
            fit.max_bytes = max(fit.max_bytes, y)
            tokens = feats.get(_TOKENS)
            if tokens:
                per = y / tokens
                fit.max_per_token = (
                    per if fit.max_per_token is None else max(fit.max_per_token, per)
                )
        fit.dirty = True

    @staticmethod
    def _predict_row(fit: _StageFit, row: tuple[float, ...], tokens: float | None) -> float:
        got = fit.fit_of(row)
        return got if got is not None else fit.fallback(tokens)

    def predict(self, stage: int, features: Mapping[str, float]) -> float:
        """The predicted activation bytes of a microbatch of ``features`` on ``stage``: the
        fit's where it ``covers`` the features, else the fallback (module note); >= 0.

        Args:
            stage: The virtual stage.
            features: The microbatch's size features (those of the stage's observations).

        Returns:
            The bytes, a float >= 0.

        Raises:
            PlanError: A bad stage or feature (as ``observe``), or nothing observed on the
                stage yet.
        """
        return self.predict_many(stage, [features])[0]

    def predict_many(self, stage: int, features: Sequence[Mapping[str, float]]) -> list[float]:
        """``predict`` of each of ``features`` (a step's microbatches), in one pass.

        Raises:
            PlanError: As ``predict``.
        """
        stage = self._stage(stage)
        fit = self._fit(stage)
        feats = [self._features(stage, f) for f in features]
        got = fit.fit_many([self._row(stage, fit, f) for f in feats])
        return [
            g if g is not None else fit.fallback(f.get(_TOKENS))
            for f, g in zip(feats, got, strict=True)
        ]

    def covers(self, stage: int, features: Mapping[str, float]) -> bool:
        """Whether ``predict(stage, features)`` is the fit's (not the fallback's): the stage
        is ready, the features lie in the span of the sizes observed and the fit is >= 0.

        Raises:
            PlanError: As ``predict``.
        """
        stage = self._stage(stage)
        fit = self._fit(stage)
        return fit.fit_of(self._row(stage, fit, self._features(stage, features))) is not None

    def ready(self, stage: int) -> bool:
        """Whether ``stage`` has as many distinct sizes observed as it has columns that are
        not all zero (False before any observation): enough to fit, if the sizes vary
        along every column (``covers`` says for a given size).

        Raises:
            PlanError: A bad stage.
        """
        fit = self._stages.get(self._stage(stage))
        if fit is None:
            return False
        if fit.dirty:
            fit.refit()
        return fit.is_ready

    def error(self, stage: int) -> float:
        """The largest relative error ``|predicted - measured| / measured`` (measured taken
        as at least 1 byte) over the stage's most recent out-of-sample predictions (the last
        ``error_window`` observations made while the stage was ready, each predicted before
        it was added); NaN when there is none yet.

        Raises:
            PlanError: A bad stage.
        """
        fit = self._stages.get(self._stage(stage))
        if fit is None or not fit.errors:
            return math.nan
        return max(fit.errors)

    def observations(self, stage: int) -> int:
        """How many observations ``stage`` has had (all of them, not only the window's).

        Raises:
            PlanError: A bad stage.
        """
        fit = self._stages.get(self._stage(stage))
        return 0 if fit is None else fit.count

    def columns(self, stage: int) -> tuple[str, ...]:
        """The names of ``stage``'s columns (``"1"``, ``"tokens"``, ``"tokens**2"``, the
        other features, the extra ones); empty before its first observation.

        Raises:
            PlanError: A bad stage.
        """
        fit = self._stages.get(self._stage(stage))
        return () if fit is None else fit.columns


def _tensor_type() -> type[Any] | None:
    """``torch.Tensor`` if torch is imported (a tensor cannot exist before), else None."""
    torch = sys.modules.get("torch")
    return None if torch is None else getattr(torch, "Tensor", None)


def _tokens_of(t: Any) -> int:
    """Tokens of a tensor: every element of an integer tensor (token ids); every row along
    the last dimension of a floating one (embeddings, hidden states: ``[..., d]``)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return int(t.numel() // t.shape[-1]) if t.dim() and t.shape[-1] else 0
    return int(t.numel())


def features_of(microbatch: object) -> dict[str, float]:
    """The size features of a microbatch, for ``ActivationModel``.

    * ``rr.Microbatch``: its declared sizes, ``tokens``, ``patches`` and ``images`` (what
      the cost model and the hints read; its ``data`` is not looked at: call
      ``features_of(mb.data)`` where the declared tokens count something else, such as the
      tokens a loss averages over);
    * a tensor: ``tokens``, every element of an integer tensor (token ids, padding included:
      the activations are computed for the padding too), every row along the last
      dimension of a floating one (``[batch, seq, hidden]`` -> ``batch * seq``);
    * a mapping (Hugging Face keyword inputs): ``tokens`` from ``input_ids`` (or
      ``inputs_embeds``); with ``pixel_values`` ``[..., C, H, W]`` also ``images`` (the
      product of the leading dimensions) and ``pixels`` (``images * H * W``);
    * any other object with an int ``tokens`` (and ``patches``, ``images``) attribute.

    ``tokens**2`` (the model's default square column) is then the square of all a
    microbatch's tokens: exact for one sequence per microbatch or a fixed number of rows;
    for a varying number of rows pass an extra feature (``FeatureFn``).

    Args:
        microbatch: The microbatch.

    Returns:
        Feature name -> value.

    Raises:
        PlanError: No size can be read from ``microbatch``.
    """
    if isinstance(microbatch, Microbatch):
        return {
            "tokens": float(microbatch.tokens),
            "patches": float(microbatch.patches),
            "images": float(microbatch.images),
        }
    tensor = _tensor_type()
    if tensor is not None and isinstance(microbatch, tensor):
        return {"tokens": float(_tokens_of(microbatch))}
    if isinstance(microbatch, Mapping):
        out: dict[str, float] = {}
        ids = microbatch.get("input_ids")
        if ids is None:
            ids = microbatch.get("inputs_embeds")
        if tensor is not None and isinstance(ids, tensor):
            out["tokens"] = float(_tokens_of(ids))
        px = microbatch.get("pixel_values")
        if tensor is not None and isinstance(px, tensor) and px.dim() >= 3:
            images = math.prod(px.shape[:-3])
            out["images"] = float(images)
            out["pixels"] = float(images * px.shape[-2] * px.shape[-1])
        if out:
            return out
        raise PlanError(
            "features_of: no size found in a mapping with keys"
            f" {sorted(map(str, microbatch))[:8]} (it reads the tensors input_ids,"
            " inputs_embeds and pixel_values): give the features yourself"
        )
    n = getattr(microbatch, "tokens", None)
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        out = {"tokens": float(n)}
        for name in ("patches", "images"):
            v = getattr(microbatch, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                out[name] = float(v)
        return out
    raise PlanError(
        f"features_of: cannot read the size of {describe(microbatch)}: pass an rr.Microbatch,"
        " a tensor, a mapping with input_ids / pixel_values, or give the features yourself"
    )
