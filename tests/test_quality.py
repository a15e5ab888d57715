"""Heuristic quality filters: prose in several languages survives, boilerplate is dropped with its reason."""

from __future__ import annotations

import gzip
import json
import re

import pytest
from pydantic import ValidationError

from crawl2chat.stages.data.quality import C4Filter, FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter, NgramStats, build_quality_blocks
from crawl2chat.stages.data.settings import C4Config, GopherQualityConfig, QualityConfig
from crawl2chat.stages.data.text import count_sentences, is_unspaced, split_words, stop_words, unspaced_fraction

ENGLISH = (
    "The Rhine is one of the longest and most important rivers in Europe. It rises in the Swiss Alps "
    "and flows for about 1,230 kilometres before it reaches the North Sea in the Netherlands. Along the "
    "way it passes through Lake Constance, forms part of the border between Germany and France, and "
    "runs past cities such as Basel, Cologne and Rotterdam. Since Roman times the river has been a major "
    "trade route, and today barges carry millions of tonnes of goods on it every year.\n\n"
    "The quality of its water has improved a great deal since the 1970s. After a chemical fire near "
    "Basel in 1986, the countries along the river agreed on a joint programme to clean it up. Salmon, "
    "which had disappeared for decades, have returned to several of its tributaries."
)

GERMAN = (
    "Der Rhein ist einer der längsten und wichtigsten Flüsse Europas. Er entspringt in den Schweizer "
    "Alpen und mündet nach rund 1230 Kilometern in den Niederlanden in die Nordsee. Auf seinem Weg "
    "fließt er durch den Bodensee, bildet einen Teil der Grenze zwischen Deutschland und Frankreich und "
    "passiert Städte wie Basel, Mainz, Köln und Düsseldorf. Seit der Römerzeit ist der Fluss eine "
    "bedeutende Handelsstraße, auf der heute jedes Jahr Millionen Tonnen Güter transportiert werden. "
    "Das Mittelrheintal zwischen Bingen und Koblenz gehört seit 2002 zum Welterbe der UNESCO.\n\n"
    "Die Wasserqualität des Flusses hat sich seit den 1970er Jahren deutlich verbessert. Nach einem "
    "Brand bei einem Chemieunternehmen in Basel im Jahr 1986 beschlossen die Anrainerstaaten ein "
    "gemeinsames Aktionsprogramm. Heute leben wieder Lachse im Rhein, die lange als ausgestorben galten."
)

JAPANESE = (
    "富士山は静岡県と山梨県にまたがる活火山で、標高は三七七六メートルと日本で最も高い山である。"
    "その美しい円錐形の姿は古くから多くの人々に親しまれ、和歌や浮世絵の題材として繰り返し描かれてきた。"
    "最後の噴火は一七〇七年の宝永噴火で、このとき江戸の町にも火山灰が降り積もったと記録されている。"
    "毎年七月から九月の登山シーズンには、国内外から二十万人以上の登山者が山頂を目指す。"
    "二〇一三年には「富士山－信仰の対象と芸術の源泉」として世界文化遺産に登録された。\n\n"
    "山麓には富士五湖と呼ばれる湖が点在し、季節ごとに異なる景色を楽しむことができる。"
    "冬の晴れた日には、東京の都心からもその姿を望むことができる。"
)

CHINESE = (
    "长城是中国古代的军事防御工程，其修筑历史可以追溯到西周时期。"
    "秦始皇统一六国之后，将原来各国修建的城墙连接起来，形成了后来所说的万里长城。"
    "现存的长城大部分是明朝时期修建的，东起山海关，西至嘉峪关，全长六千多公里。"
    "长城沿线设有关隘、烽火台和城堡，用来传递军情和驻守士兵。"
    "一九八七年，长城被联合国教科文组织列入世界文化遗产名录。\n\n"
    "今天，八达岭和慕田峪等地段已经成为著名的旅游景点，每年吸引数以百万计的游客前来参观。"
    "与此同时，许多偏远地段由于风雨侵蚀和人为破坏，正面临着严重的保护问题。"
)

PROSE = {"en": ENGLISH, "de": GERMAN, "ja": JAPANESE, "zh": CHINESE}

# Shorter single-paragraph prose in more scripts (Cyrillic, Latin, Hangul, Arabic, Devanagari).
MORE_PROSE = {
    "ru": (
        "Байкал — озеро тектонического происхождения в южной части Восточной Сибири. "
        "Это самое глубокое озеро на планете и крупнейший природный резервуар пресной воды. "
        "Озеро и прибрежные территории отличаются уникальным разнообразием флоры и фауны. "
        "Местные жители и многие в России традиционно называют Байкал морем. "
        "Площадь водной поверхности составляет около тридцати одной тысячи квадратных километров. "
        "С 1996 года озеро входит в список объектов всемирного наследия ЮНЕСКО."
    ),
    "fr": (
        "La Loire est le plus long fleuve de France. "
        "Elle prend sa source au mont Gerbier de Jonc, dans le Massif central, et se jette dans l'océan Atlantique près de Saint-Nazaire. "
        "Son cours traverse de nombreuses villes historiques comme Orléans, Blois, Tours et Angers. "
        "La vallée est célèbre pour ses châteaux de la Renaissance, construits pour la plupart aux quinzième et seizième siècles. "
        "Depuis 2000, une partie de la vallée est inscrite au patrimoine mondial de l'UNESCO. "
        "Le fleuve reste assez sauvage, car il a été peu aménagé pour la navigation."
    ),
    "ko": (
        "서울은 대한민국의 수도이자 최대 도시이다. "
        "한강을 중심으로 남북으로 나뉘어 있으며, 조선 시대부터 나라의 중심지 역할을 해 왔다. "
        "도시에는 경복궁과 창덕궁 같은 오래된 궁궐이 남아 있다. "
        "오늘날 서울은 금융과 문화, 기술의 중심지로 세계적으로 알려져 있다. "
        "지하철과 버스 같은 대중교통이 잘 발달되어 있어 이동이 편리하다. "
        "매년 수많은 관광객이 서울을 찾아 음식과 쇼핑, 역사 유적을 즐긴다."
    ),
    "ar": (
        "القاهرة هي عاصمة جمهورية مصر العربية وأكبر مدنها. "
        "تقع المدينة على ضفاف نهر النيل في شمال البلاد. "
        "يعود تاريخ المدينة إلى أكثر من ألف عام، وقد كانت مركزا مهما للعلم والثقافة. "
        "تضم القاهرة العديد من المساجد والأسواق القديمة والمتاحف. "
        "يعيش في المدينة وما حولها أكثر من عشرين مليون نسمة. "
        "وتعد الأهرامات القريبة في الجيزة من أشهر المعالم السياحية في العالم."
    ),
    "hi": (
        "गंगा भारत की सबसे महत्वपूर्ण नदियों में से एक है। "
        "यह हिमालय के गंगोत्री हिमनद से निकलती है और बंगाल की खाड़ी में गिरती है। "
        "इसके किनारे पर वाराणसी, प्रयागराज और पटना जैसे कई प्राचीन शहर बसे हुए हैं। "
        "करोड़ों लोग इस नदी के पानी पर खेती और पीने के लिए निर्भर हैं। "
        "हिंदू धर्म में गंगा को एक पवित्र नदी माना जाता है। "
        "हाल के वर्षों में इसकी सफाई के लिए कई सरकारी योजनाएं चलाई गई हैं।"
    ),
}


def make_doc(text, lang="en", i=0):
    return {"id": f"doc{i}", "url": f"https://example.com/{i}", "text": text, "lang": lang,
            "lang_score": 0.99, "drop_reason": None}


def run_blocks(blocks, docs):
    for block in blocks:
        docs = block.run(docs)
    return list(docs)


def run_default(doc):
    return run_blocks(build_quality_blocks(QualityConfig()), [doc])[0]


@pytest.mark.parametrize("lang", sorted(PROSE))
def test_prose_in_four_languages_passes_every_filter(lang):
    doc = run_default(make_doc(PROSE[lang], lang))
    assert doc["drop_reason"] is None
    assert doc["quality_score"] == 1.0
    # C4 kept every line, including the paragraph break.
    assert doc["text"] == PROSE[lang]


@pytest.mark.parametrize("lang", sorted(MORE_PROSE))
def test_prose_in_more_scripts_passes_every_filter(lang):
    doc = run_default(make_doc(MORE_PROSE[lang], lang))
    assert doc["drop_reason"] is None and doc["text"] == MORE_PROSE[lang]


def test_cjk_prose_passes_even_when_lang_is_unknown():
    # Language ID can fail; the script alone must keep word rules from misfiring.
    for text in (JAPANESE, CHINESE):
        assert run_default(make_doc(text, lang=None))["drop_reason"] is None


def test_real_german_paragraph_passes(shared_data):
    text = (shared_data / "bpe" / "german.txt").read_text(encoding="utf-8")
    # The Wikipedia paragraph has three sentences, so C4's five-sentence page rule drops
    # it (as it would an English stub); every other rule keeps it.
    assert run_default(make_doc(text, "de"))["drop_reason"] == "c4:too_few_sentences"
    blocks = build_quality_blocks(QualityConfig(c4=C4Config(min_sentences=3)))
    doc = run_blocks(blocks, [make_doc(text, "de")])[0]
    assert doc["drop_reason"] is None
    assert doc["text"] == text.strip().removesuffix("[2]")  # C4 removed the citation mark


MENU = "\n".join(["Home", "About us", "Products", "Services", "Blog", "Careers", "Contact", "Login",
                  "Register", "Cart", "Search", "Help", "FAQ", "Sitemap"] * 2)
REPEATED = "\n".join(["Click here to claim your free prize now, limited offer for our members."] * 12)
LOREM = (
    ENGLISH + "\n\nLorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt."
)
SYMBOL_SOUP = " ".join(["★★★", "|", ">>>", "»", "deal", "■■", "sale", "$$$", "top", "~~~"] * 20)
TRAILING_OFF = " ".join(f"Suddenly... another {i}... something... happened there." for i in range(20))
HASHTAGS = " ".join(f"#travel{i} #food #love photo" for i in range(20))
KEYWORDS = " ".join(f"cheap flights hotels deals booking discount offers travel {i}." for i in range(10))
CODE = ENGLISH + "\n\nCall the helper with {x: 1, y: 2} to place the widget at the top of the page."
ELLIPSIS_TEASERS = "\n".join(
    f"Read the full story about the new city council decision number {i} and what it means for..."
    for i in range(12)
)


@pytest.mark.parametrize(
    "text, reason",
    [
        (MENU, "gopher_repetition:dup_line_frac"),
        (MENU[: len(MENU) // 2], "gopher_quality:too_few_words"),
        (REPEATED, "gopher_repetition:dup_line_frac"),
        (LOREM, "c4:lorem_ipsum"),
        (CODE, "c4:curly_bracket"),
        (SYMBOL_SOUP, "gopher_repetition:top_2_gram"),
        ("", "gopher_repetition:empty"),
    ],
    ids=["menu", "short-menu", "repeated-lines", "lorem-ipsum", "code", "symbol-soup", "empty"],
)
def test_boilerplate_is_dropped_with_its_reason(text, reason):
    assert run_default(make_doc(text))["drop_reason"] == reason


@pytest.mark.parametrize(
    "text, rule",
    [
        (SYMBOL_SOUP, "too_few_alpha_words"),
        (HASHTAGS, "too_many_hashes"),
        (KEYWORDS, "too_few_stop_words"),
        (ELLIPSIS_TEASERS, "too_many_ellipsis_lines"),
        (TRAILING_OFF, "too_many_ellipses"),
        (MENU, "too_few_words"),
    ],
    ids=["symbol-soup", "hashtags", "keyword-list", "ellipsis-teasers", "ellipses", "menu"],
)
def test_gopher_quality_rules(text, rule):
    # Templated spam also repeats itself, so in the full pipeline the repetition
    # filter (which runs first) usually claims it; each rule is checked here alone.
    assert GopherQualityFilter().process(make_doc(text)) == rule


def test_bad_text_is_dropped_not_crashing():
    blocks = build_quality_blocks(QualityConfig())
    docs = run_blocks(blocks, [make_doc(None), make_doc(123, i=1), make_doc(ENGLISH, i=2)])
    assert [d["drop_reason"] for d in docs] == ["gopher_repetition:no_text"] * 2 + [None]
    assert blocks[0].stats["dropped:no_text"] == 2


def test_earlier_drops_pass_through_untouched():
    doc = make_doc(MENU)
    doc["drop_reason"] = "langid:low_score"
    out = run_default(doc)
    assert out["drop_reason"] == "langid:low_score" and "quality_score" not in out


def test_c4_removes_boilerplate_lines_and_keeps_paragraphs():
    page = "\n".join([
        "Home | Shop | Contact",
        "This site uses cookies to improve your experience, see our cookie policy.",
        "Please enable JavaScript in your browser to view this page correctly.",
        ENGLISH.replace("Basel in 1986", "Basel in 1986[3]"),
        "Share on Facebook",
        "Continue reading...",
    ])
    block = C4Filter()
    doc = run_blocks([block], [make_doc(page)])[0]
    assert doc["drop_reason"] is None
    assert doc["text"] == ENGLISH  # menu, cookie, javascript, teaser lines and the citation are gone
    assert block.stats["line_removed:no_terminal_punct"] == 3
    assert block.stats["line_removed:policy"] == 1 and block.stats["line_removed:javascript"] == 1
    # 2 of the 7 examined lines kept, plus two passed page checks (not empty, enough sentences).
    assert doc["quality_score"] == pytest.approx((2 + 2) / (7 + 2))


def test_c4_policy_substrings_are_plain_text():
    """A policy entry is matched as written, case aside: its dots and brackets are no pattern."""
    from crawl2chat.stages.data.settings import C4Config

    block = C4Filter(C4Config(policy_substrings=["(c) Ltd.", "Terms"]))
    lines = ["Copyright (C) LTD. and friends, all rights reserved.", "Copyright c Ltdx and friends, all rights.",
             "Read our terms before you go."]
    kept = [line for line in lines if block.clean_line(line, True)[1] is None]
    assert kept == ["Copyright c Ltdx and friends, all rights."]


def test_c4_punctuation_rules_accept_cjk_and_skip_thai():
    assert run_blocks([C4Filter()], [make_doc(JAPANESE, "ja")])[0]["text"] == JAPANESE
    thai = "ประเทศไทยมีประชากรประมาณหกสิบหกล้านคน และกรุงเทพมหานครเป็นเมืองหลวง"
    doc = run_blocks([C4Filter()], [make_doc(thai, "th")])[0]
    assert doc["drop_reason"] is None and doc["text"] == thai
    assert run_blocks([C4Filter()], [make_doc(thai, "en")])[0]["drop_reason"] == "c4:empty"


def test_c4_rules_are_configurable():
    cfg = C4Config(min_sentences=None, filter_no_terminal_punct=False, min_words_per_line=None)
    doc = run_blocks([C4Filter(cfg)], [make_doc("Home\nAbout us\nContact")])[0]
    assert doc["drop_reason"] is None and doc["text"] == "Home\nAbout us\nContact"
    with pytest.raises(ValidationError):
        C4Config(min_sentence=3)  # typo: unknown fields are rejected


@pytest.mark.parametrize(
    "text, reason",
    [
        ("\n".join(f"Item number {i} in the list" for i in range(20)) + "\nEnd.", "line_punct_ratio"),
        ("\n".join(["Short line here."] * 3 + [f"Entry {i}." for i in range(10)] + [ENGLISH]), "short_line_ratio"),
        (ENGLISH + "\nAll rights reserved by the owners of this website.\n"
         "All rights reserved by the owners of this website.", "char_dup_ratio"),
        ("\n".join(f"Word{i}." for i in range(30)), "short_line_ratio"),
        ("\n".join(f"A long enough line number {i} that is not short at all." for i in range(3))
         + "\n" * 40 + "Done.", "list_ratio"),
    ],
    ids=["no-punctuation", "short-lines", "duplicate-lines", "one-word-lines", "newlines"],
)
def test_fineweb_rules(text, reason):
    assert run_blocks([FineWebQualityFilter()], [make_doc(text)])[0]["drop_reason"] == f"fineweb:{reason}"


def test_gopher_word_rules_are_language_aware():
    block = GopherQualityFilter()
    # A German page must not need English stop words; a Finnish one (no list) skips the rule.
    assert block.process(make_doc(GERMAN, "de")) is None
    finnish = ("Suomi on valtio Pohjois-Euroopassa. Sen pääkaupunki on Helsinki, ja maassa asuu noin "
               "viisi ja puoli miljoonaa ihmistä. ") * 5
    assert block.process(make_doc(finnish, "fi")) is None
    # Labelled English, the same text finds almost none of the English stop words.
    assert block.process(make_doc(GERMAN, "en")) == "too_few_stop_words"
    # Mean word length is skipped for unspaced scripts (each character is a one-character word).
    assert block.process(make_doc(CHINESE, "zh")) is None
    long_words = " ".join(["Donaudampfschifffahrtsgesellschaftskapitän"] * 60)
    assert block.process(make_doc(long_words, "de")) == "long_mean_word_length"
    assert GopherQualityFilter(GopherQualityConfig(max_mean_word_length=None)).process(
        make_doc(long_words, "de")) == "too_few_stop_words"


def test_bullet_lines_rule():
    bullets = "\n".join(f"• Feature {i} of the product, with care and the best support." for i in range(12))
    assert GopherQualityFilter().process(make_doc(bullets)) == "too_many_bullet_lines"


def test_ngram_helpers():
    grams = NgramStats("a b c a b c a b c".split())
    assert grams.top_chars(3) == 9  # "a b c" three times, 3 chars each
    assert NgramStats("a b c d".split()).top_chars(2) == 0  # nothing repeats
    assert grams.duplicate_chars(3) == 6  # the 2nd and 3rd "a b c"
    assert grams.duplicate_chars(5) == 6  # 5-grams at 3 and 4 repeat: words 3..8 covered
    assert NgramStats([]).top_chars(2) == 0 and NgramStats(["a"]).duplicate_chars(2) == 0


def _top_reference(words, n):
    """Gopher's definition, written plainly: the most frequent n-gram (first among ties) x its count."""
    from collections import Counter

    counts = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    if not counts:
        return 0
    gram, count = counts.most_common(1)[0]
    return sum(len(w) for w in gram) * count if count > 1 else 0


def _dup_reference(words, n):
    seen, covered = set(), [False] * len(words)
    for i in range(len(words) - n + 1):
        gram = tuple(words[i:i + n])
        if gram in seen:
            covered[i:i + n] = [True] * n
        seen.add(gram)
    return sum(len(w) for w, c in zip(words, covered) if c)


def test_vectorised_ngram_stats_equal_the_plain_definitions():
    import random

    rng = random.Random(7)
    vocab = ["the", "river", "a", "bridge", "of", "stone", "market", "opens", "Saturday", "town", "ab", "abc"]
    for trial in range(300):
        words = [rng.choice(vocab[: rng.randint(2, len(vocab))]) for _ in range(rng.randint(0, 80))]
        grams = NgramStats(words)
        for n in (1, 2, 3, 4, 5, 7, 10):
            assert grams.top_chars(n) == _top_reference(words, n), (trial, n, words)
            assert grams.duplicate_chars(n) == _dup_reference(words, n), (trial, n, words)
        # Asked in any order, each n gives the same: longer n-grams are found from shorter ones' repeats.
        grams = NgramStats(words)
        for n in (9, 6, 10, 5, 8, 2):
            assert grams.duplicate_chars(n) == _dup_reference(words, n), (trial, n, words)


def test_repetition_scales_ngrams_on_unspaced_text():
    block = GopherRepetitionFilter()
    # A common two-character word repeated in Chinese prose is not a repeated phrase.
    assert block.process(make_doc(CHINESE, "zh")) is None
    spam = "最新优惠活动马上参加" * 20
    assert block.process(make_doc(spam, "zh")).startswith("top_")


def test_text_helpers():
    assert count_sentences("Es gibt 16.937 Studenten. Das ist viel! Oder?") == 3
    assert count_sentences("富士山は高い。とても美しい！") == 2
    assert is_unspaced(JAPANESE) and is_unspaced("", "zh") and not is_unspaced(GERMAN, "de")
    # Unspaced characters over every character that is not white space (Unicode's, as regex \s).
    for text in ("東京 tokyo", "東京\u3000\u2009東京\xa0ab\n", "", "  \t", "no such script", "ภาษาไทย คือ"):
        spaces = sum(len(m) for m in re.findall(r"\s+", text))
        unspaced = len(re.findall(r"[\u3040-\u30ff\u4e00-\u9fff\u0e00-\u0e7f]", text))
        assert unspaced_fraction(text) == (unspaced / (len(text) - spaces) if unspaced else 0.0), text
    assert stop_words("en") == {"the", "be", "to", "of", "and", "that", "have", "with"}
    assert stop_words("ja") is None
    # Indic vowel signs and decomposed accents stay inside their words.
    assert split_words("सबसे महत्वपूर्ण नदियों") == ["सबसे", "महत्वपूर्ण", "नदियों"]
    assert split_words("cafe\u0301 it's well-known") == ["cafe\u0301", "it's", "well-known"]


def test_disabled_blocks_are_left_out():
    cfg = QualityConfig.model_validate({"c4": {"enabled": False}, "fineweb": {"enabled": False}})
    assert [b.name for b in build_quality_blocks(cfg)] == ["gopher_repetition", "gopher_quality", "harmful"]
    cfg = QualityConfig.model_validate({"c4": {"enabled": False}, "fineweb": {"enabled": False},
                                        "harmful": {"enabled": False}})
    assert [b.name for b in build_quality_blocks(cfg)] == ["gopher_repetition", "gopher_quality"]


def test_real_common_crawl_pages(shared_data):
    files = sorted((shared_data / "cc_docs" / "dolma").glob("*.gz"))
    assert len(files) == 3
    docs = []
    for path in files:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            docs += [make_doc(json.loads(line)["text"], "en", len(docs)) for line in f]
    blocks = build_quality_blocks(QualityConfig())
    out = run_blocks(blocks, docs)
    assert len(out) == len(docs) == 30
    kept = [d for d in out if d["drop_reason"] is None]
    dropped = [d for d in out if d["drop_reason"]]
    names = {b.name for b in blocks}
    assert all(d["drop_reason"].split(":")[0] in names for d in dropped)
    assert all(0.0 <= d["quality_score"] <= 1.0 and d["text"] for d in kept)
    # Real articles survive; the room-booking calendar page and the navigation-heavy pages do not.
    assert 15 <= len(kept) <= 27
    assert any("Meeting Room Booking System" in d["text"] and d["drop_reason"] for d in out)
    # C4 strips navigation lines from kept pages, so their score drops below 1.
    assert not any(line == "CPDLab Home" for d in kept for line in d["text"].split("\n"))
    assert any(d["quality_score"] < 0.9 for d in kept)


def test_reference_page_kept_without_its_repeated_member_runs():
    """A real reference page (pydoc's text for ``builtins``: every exception class repeats
    the members it inherits) fails the repetition rules as published; with
    ``repair_runs`` it is kept without the copies, and no distinct line is lost."""
    import builtins
    import pydoc

    from crawl2chat.stages.data.quality import GopherRepetitionFilter, remove_repeated_runs
    from crawl2chat.stages.data.settings import GopherRepetitionConfig
    from crawl2chat.stages.settings import DOCS_PROFILE

    page = pydoc.render_doc(builtins, renderer=pydoc.plaintext)
    docs_rules = {k.rsplit(".", 1)[1]: v for k, v in DOCS_PROFILE.items() if k.startswith("quality.gopher_repetition.")}
    assert docs_rules["repair_runs"] == 3
    dropping = GopherRepetitionFilter(GopherRepetitionConfig(**{**docs_rules, "repair_runs": None}))
    doc = {"id": "b", "text": page, "lang": "en"}
    assert dropping.process(dict(doc)) is not None  # as published: dropped whole

    repairing = GopherRepetitionFilter(GopherRepetitionConfig(**docs_rules))
    kept = dict(doc)
    assert repairing.process(kept) is None
    assert kept["repeated_lines"] > 1000 and len(kept["text"]) < len(page) / 2
    assert {line.strip() for line in kept["text"].splitlines()} == {line.strip() for line in page.splitlines()}
    assert repairing.stats["repaired"] == 1
    # A page with nothing repeated is judged as it is; a run overlapping itself is no copy.
    assert remove_repeated_runs("a\nb\nc\nd", 3) == ("a\nb\nc\nd", 0)
    assert remove_repeated_runs("x\nx\nx\nx", 3) == ("x\nx\nx\nx", 0)
    assert remove_repeated_runs("a\nb\nc\nz\na\nb\nc", 3) == ("a\nb\nc\nz", 3)
