"""Body decoding and HTML-to-text extraction on real multilingual pages built here."""

from __future__ import annotations

import pydantic
import pytest

from crawl2chat.stages.data import extract
from crawl2chat.stages.data.extract import (
    body_to_text,
    decode_body,
    html_to_text,
    looks_binary,
    parse_content_type,
    sniff_html,
)
from crawl2chat.stages.data.settings import ExtractConfig

ARTICLE = (
    "The river town grew around a stone bridge built in the twelfth century, and its market "
    "still opens every Saturday morning on the square beside the old customs house."
)

PAGE = f"""<!doctype html><html><head><title>River town</title></head><body>
<nav><ul><li><a href="/">Home</a></li><li><a href="/about">About us</a></li>
<li><a href="/contact">Contact</a></li></ul></nav>
<main><article><h1>A short history of the river town</h1>
<p>{ARTICLE}</p>
<p>Merchants from three valleys brought wool, salt and timber, and the town's guild hall, finished in 1421,
is now a museum that keeps the original ledgers of the wool trade open to visitors.</p>
</article></main>
<footer><p>Copyright 2024 Example Media. All rights reserved. Privacy policy. Cookie settings.</p></footer>
</body></html>"""


@pytest.mark.parametrize("extractor", ["resiliparse", "trafilatura"])
def test_html_to_text_keeps_article_and_drops_navigation(extractor):
    text = html_to_text(PAGE, extractor)
    assert ARTICLE in " ".join(text.split())
    assert "guild hall" in text
    lines = [line.strip() for line in text.splitlines()]
    assert "Home" not in lines and "About us" not in lines
    assert "<p>" not in text


@pytest.mark.parametrize("extractor", ["resiliparse", "trafilatura"])
def test_html_to_text_of_empty_page_is_empty(extractor):
    assert html_to_text("<html><body><script>var x = 1;</script></body></html>", extractor).strip() == ""


def test_warm_up_pays_trafilaturas_first_use_costs_in_advance():
    """The warm-up takes Trafilatura's fallback path once (a fresh process: jusText's
    stop-word list is built there) and leaves extraction as it was."""
    import subprocess
    import sys

    code = ("import trafilatura.external as ex\n"
            "from crawl2chat.stages.data.extract import html_to_text, warm_up\n"
            "assert ex.JT_STOPLIST is None\n"
            "page = '<html><body><article><p>' + 'Words that make a page. ' * 40 + '</p></article></body></html>'\n"
            "before = html_to_text(page, 'trafilatura')\n"
            "warm_up('resiliparse')\n"
            "assert ex.JT_STOPLIST is None  # Resiliparse has nothing to warm\n"
            "warm_up('trafilatura')\n"
            "assert ex.JT_STOPLIST, 'the warm-up did not reach the fallback path'\n"
            "assert html_to_text(page, 'trafilatura') == before\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_html_to_text_rejects_unknown_extractor():
    with pytest.raises(ValueError, match="unknown extractor"):
        html_to_text(PAGE, "lynx")


def test_a_repeated_html_body_is_extracted_once(monkeypatch):
    calls = []
    real = extract.html_to_text

    def counting(html, extractor="resiliparse"):
        calls.append(extractor)
        return real(html, extractor)

    monkeypatch.setattr(extract, "html_to_text", counting)
    body = PAGE.replace("river town", "river town of Käsberg").encode("utf-8")
    first = body_to_text(body, "utf-8", True, "resiliparse")
    assert "Käsberg" in first and "Cookie settings" not in first
    assert body_to_text(body, "utf-8", True, "resiliparse") == first
    assert calls == ["resiliparse"]
    # What the text depends on is part of the key: the declared charset, the extractor, the bytes.
    latin = body_to_text(body, "iso-8859-1", True, "resiliparse")
    assert "KÃ¤sberg" in latin
    assert body_to_text(body, "utf-8", True, "trafilatura").count("Käsberg") >= 1
    assert "Käsberg" in body_to_text(body + b"<!-- x -->", "utf-8", True, "resiliparse")
    assert calls == ["resiliparse", "resiliparse", "trafilatura", "resiliparse"]
    # A text body is decoded, never extracted.
    assert body_to_text(b"plain words", "utf-8", False) == "plain words"
    assert len(calls) == 4


def test_decode_trusts_http_charset_when_it_decodes():
    body = "<p>广东省人民政府门户网站，发布政务信息。</p>".encode("gbk")
    assert "广东省人民政府" in decode_body(body, "gbk")


def test_decode_uses_meta_charset_without_http_charset():
    body = (
        '<html><head><meta http-equiv="Content-Type" content="text/html; charset=Shift_JIS"></head>'
        "<body><p>日本語のウェブページです。東京の天気は晴れ。</p></body></html>"
    ).encode("shift_jis")
    assert "東京の天気は晴れ" in decode_body(body, None)


def test_decode_detects_latin1_mislabelled_as_utf8():
    body = "<p>Die Größe der Straße überrascht: über hundert Häuser stehen dort.</p>".encode("latin-1")
    text = decode_body(body, "utf-8")
    assert "Größe der Straße" in text and "\ufffd" not in text


def test_decode_detects_gbk_mislabelled_as_utf8():
    sentence = "今天的天气非常好，我们一起去公园散步，然后在湖边的餐厅吃午饭。" * 3
    body = f"<html><body><p>{sentence}</p></body></html>".encode("gbk")
    assert sentence in decode_body(body, "utf-8")


def test_decode_maps_web_labels_and_strips_bom():
    # On the web "iso-8859-1" means windows-1252, where 0x93/0x94 are curly quotes.
    assert decode_body(b"\x93quoted\x94", "iso-8859-1") == "\u201cquoted\u201d"
    assert decode_body("\ufeffHallo".encode("utf-8"), "utf-8") == "Hallo"
    assert decode_body("plain ascii".encode(), "no-such-charset") == "plain ascii"


def test_content_type_helpers():
    assert parse_content_type('text/HTML; charset="GBK"') == ("text/html", "gbk")
    assert parse_content_type("application/pdf") == ("application/pdf", None)
    assert parse_content_type(None) == (None, None)
    assert sniff_html(b"  <!DOCTYPE html><html>") and not sniff_html(b"just words")
    assert looks_binary(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    assert not looks_binary("Grüße".encode("utf-16"))  # BOM-marked UTF-16 is text
    assert not looks_binary(b"<html>plain</html>")


def test_extract_config_defaults_and_forbids_unknown_fields():
    config = ExtractConfig()
    assert config.extractor == "resiliparse"
    assert config.max_record_bytes == 10_000_000
    assert "text/html" in config.html_content_types
    with pytest.raises(pydantic.ValidationError):
        ExtractConfig(max_record_byte=5)
    with pytest.raises(pydantic.ValidationError):
        ExtractConfig(extractor="lynx")
