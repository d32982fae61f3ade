"""``spec.speculative``: speculative decoding, built in and measured by the build.

Absent or ``method: off`` is no speculation. ``method: ngram`` is prompt lookup (no draft model);
``method: draft_model`` has a smaller model of the same tokenizer (``draftModel``, any source
``spec.model`` accepts, GGUF included) propose its greedy continuation; the build converts it
into the same artifact. Either way the build's ``speculative`` stage then times decoding with and without drafts on the target over
batch sizes and draft lengths, and records per running-batch bucket whether to speculate and with
which ``k`` (at most ``numSpeculativeTokens``) in ``engine.json`` (docs/speculative.md). All of it
is in the build envelope (:mod:`kiln.envelope`): the table is part of the artifact.

:data:`SPECULATIVE_RULES` are this part's cross-field rules (CEL, joined into
``kiln.api.CROSS_FIELD_RULES``); :func:`speculative_problems` is their Python twin.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.api_base import APIModel as _Model
from kiln.model_source import ModelSource, scheme_problems

SpeculativeMethod = Literal["off", "ngram", "draft_model"]
MAX_SPECULATIVE_TOKENS = 8
MAX_PROMPT_LOOKUP = 8


class SpeculativeOptions(_Model):
    method: SpeculativeMethod = Field(
        default="off",
        description="Draft source: off (no speculation), ngram (prompt lookup: drafts are the tokens that "
        "followed the latest earlier occurrence of the request's last n tokens in its prompt and output) or "
        "draft_model (draftModel proposes its greedy continuation).",
    )
    draft_model: ModelSource | None = Field(
        default=None,
        description="method draft_model only: the draft checkpoint, any source spec.model accepts (GGUF "
        "included); a smaller model sharing the target's tokenizer (e.g. Qwen2.5-0.5B for Qwen2.5-7B). Built "
        "into the same artifact, with the target's dtype and quantization.",
    )
    num_speculative_tokens: int = Field(
        default=4, ge=1, le=MAX_SPECULATIVE_TOKENS,
        description="Most draft tokens per request per step (k), 1 to 8; the build measures 2 and k and records "
        "per batch bucket which pays, if any.",
    )
    prompt_lookup_max: int = Field(
        default=3, ge=1, le=MAX_PROMPT_LOOKUP, description="Longest suffix n-gram looked up, 1 to 8.",
    )
    prompt_lookup_min: int = Field(
        default=1, ge=1, le=MAX_PROMPT_LOOKUP,
        description="Shortest suffix n-gram looked up, 1 to 8; at most promptLookupMax.",
    )

    @property
    def is_on(self) -> bool:
        return self.method != "off"


# (python check name, CEL rule on spec, message, fieldPath), joined to kiln.api.CROSS_FIELD_RULES.
SPECULATIVE_RULES: tuple[tuple[str, str, str, str], ...] = (
    ("lookup_bounds",
     "!has(self.speculative) || self.speculative.promptLookupMin <= self.speculative.promptLookupMax",
     "spec.speculative.promptLookupMin must be at most promptLookupMax; lower promptLookupMin or raise "
     "promptLookupMax", ".speculative.promptLookupMin"),
    ("draft_model_source",
     "!has(self.speculative) || (self.speculative.method == 'draft_model') == has(self.speculative.draftModel)",
     "spec.speculative.draftModel is set exactly when spec.speculative.method is draft_model; set both or "
     "neither", ".speculative.draftModel"),
    ("draft_file_scheme",
     "!has(self.speculative) || !has(self.speculative.draftModel) || !has(self.speculative.draftModel.file) "
     "|| self.speculative.draftModel.source.startsWith('hf://')",
     "spec.speculative.draftModel.file is only used by hf:// sources; name the .gguf file in "
     "spec.speculative.draftModel.source instead", ".speculative.draftModel.file"),
    ("draft_credentials",
     "!has(self.speculative) || !has(self.speculative.draftModel) "
     "|| !has(self.speculative.draftModel.credentialsSecret) "
     "|| ((self.speculative.draftModel.source.startsWith('hf://') "
     "|| self.speculative.draftModel.source.startsWith('s3://')) && (!has(self.model.credentialsSecret) "
     "|| self.model.credentialsSecret == self.speculative.draftModel.credentialsSecret))",
     "spec.speculative.draftModel.credentialsSecret is only used by hf:// and s3:// sources, and must be "
     "spec.model.credentialsSecret when both are set (the fetch holds one set of model credentials)",
     ".speculative.draftModel.credentialsSecret"),
    ("drafts_fit_step",
     "!has(self.speculative) || self.speculative.method == 'off' "
     "|| self.speculative.numSpeculativeTokens < self.maxNumTokens",
     "spec.speculative.numSpeculativeTokens must be less than spec.maxNumTokens (a verified row is 1 + k tokens "
     "of one step); lower numSpeculativeTokens or raise maxNumTokens", ".speculative.numSpeculativeTokens"),
)


def speculative_problems(speculative: SpeculativeOptions | None, max_num_tokens: int,
                         model_secret: str | None = None) -> list[str]:
    """The Python twins of :data:`SPECULATIVE_RULES`, one ``<field path>: <what + fix>`` line each
    (``model_secret``: ``spec.model.credentialsSecret``)."""
    if speculative is None:
        return []
    problems = []
    draft = speculative.draft_model
    if draft is not None:
        problems += scheme_problems(draft, "speculative.draftModel")
        if (draft.credentials_secret is not None and draft.scheme in ("hf", "s3") and model_secret is not None
                and model_secret != draft.credentials_secret):
            problems.append(f"speculative.draftModel.credentialsSecret: must be spec.model.credentialsSecret "
                            f"({model_secret}) when both are set, not {draft.credentials_secret}: the fetch holds "
                            f"one set of model credentials; put both tokens' access in one Secret")
    if speculative.prompt_lookup_min > speculative.prompt_lookup_max:
        problems.append(f"speculative.promptLookupMin: must be at most promptLookupMax ({speculative.prompt_lookup_min}"
                        f" > {speculative.prompt_lookup_max}); lower promptLookupMin or raise promptLookupMax")
    if (speculative.method == "draft_model") != (speculative.draft_model is not None):
        problems.append(f"speculative.draftModel: set exactly when method is draft_model (method is "
                        f"{speculative.method}, draftModel is {'set' if speculative.draft_model else 'unset'}); "
                        f"set both or neither")
    if speculative.is_on and speculative.num_speculative_tokens >= max_num_tokens:
        problems.append(f"speculative.numSpeculativeTokens: must be less than maxNumTokens "
                        f"({speculative.num_speculative_tokens} >= {max_num_tokens}): a verified row is 1 + k tokens "
                        f"of one step; lower numSpeculativeTokens or raise maxNumTokens")
    return problems
