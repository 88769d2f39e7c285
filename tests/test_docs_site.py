"""The documentation site as it is published: built with `mkdocs build --strict` into the test's tmp
dir, every internal link and anchor of the built HTML resolves, and a person opening the home page,
an engine-integration page and a runbook in a browser (headless Chromium, as the Flower test
does) sees each page's title and the site's navigation. Screenshots are kept in the tmp dir.

The HTML check is wider than mkdocs' own validation (links between Markdown pages and their
anchors): it also covers the navigation, the theme's links, links to static files (a benchmark's
raw results) and anchors the generated pages write.
"""

from __future__ import annotations

import functools
import html.parser
import os
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from headless import chromium
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

ROOT = Path(__file__).resolve().parent.parent
WINDOW = (1280, 900)
# What a person opens first, when integrating, and when paged: (path in the site, its title).
# (path in the site, the page's heading, its title in the navigation and the browser's tab).
PAGES = [
    ("", "k8s-dispatch", "What it is"),
    ("engine/python/", "Python: schedule in your transaction", "Python, in your transaction"),
    ("runbooks/K8sDispatchNoPoll/", "K8sDispatchNoPoll", "K8sDispatchNoPoll"),
]
# Where the site is published (mkdocs.yml's site_url): the 404 page links by absolute path under it.
SITE_PATH = urllib.parse.urlsplit(
    next(
        line.split(":", 1)[1].strip()
        for line in (ROOT / "mkdocs.yml").read_text().splitlines()
        if line.startswith("site_url:")
    )
).path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as `make lint` builds it but not quiet: mkdocs 1.6's --quiet also hides the
    warnings --strict counts, and the build then exits 0."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    warnings = [line for line in done.stderr.splitlines() if not line.startswith("INFO")]
    assert done.returncode == 0, "\n".join(warnings)
    assert warnings == []
    print(f"site built in {out}")
    return out


class _Links(html.parser.HTMLParser):
    """The ids a page defines and the links it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for key in ("id", "name"):
            if values.get(key):
                self.ids.add(str(values[key]))
        if tag == "a" and values.get("href") is not None:
            self.hrefs.append(str(values["href"]))


@functools.cache
def _parsed(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _target(site: Path, page: Path, href: str) -> tuple[Path, str] | None:
    """The file and fragment an internal link leads to; None for an external one."""
    parts = urllib.parse.urlsplit(href)
    if parts.scheme or parts.netloc:
        return None
    path = urllib.parse.unquote(parts.path)
    if path.startswith("/"):  # absolute, under the published site's path
        if not path.startswith(SITE_PATH):
            return site / "(outside the published site)" / path.lstrip("/"), ""
        path = str(site / path[len(SITE_PATH) :])
    target = page if not path else (page.parent / path).resolve()
    if target.is_dir() or path.endswith("/"):
        target = target / "index.html"
    return target, urllib.parse.unquote(parts.fragment)


def test_every_internal_link_and_anchor_resolves(site: Path) -> None:
    broken = []
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 30
    for page in pages:
        for href in _parsed(page).hrefs:
            found = _target(site, page, href)
            if found is None:
                continue
            target, fragment = found
            where = f"{page.relative_to(site)}: {href}"
            if not target.is_relative_to(site.resolve()) and not target.is_relative_to(site):
                broken.append(f"{where} leaves the site")
            elif not target.is_file():
                broken.append(f"{where}: no {target.relative_to(site)}")
            elif fragment and target.suffix == ".html" and fragment not in _parsed(target).ids:
                broken.append(f"{where}: no anchor #{fragment}")
    assert broken == []


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP, as a reader's browser gets it (search and assets load by URL)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    with chromium(window=WINDOW, page_load_timeout_s=60) as driver:
        yield driver


@pytest.mark.parametrize(("path", "heading", "title"), PAGES, ids=[p or "home" for p, _, _ in PAGES])
def test_a_reader_sees_the_page(
    served: str, browser: WebDriver, tmp_path: Path, path: str, heading: str, title: str
) -> None:
    browser.get(served + path)
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
    assert browser.find_element(By.CSS_SELECTOR, "article h1").text.strip() == heading
    assert browser.title == f"{title} - k8s-dispatch"
    navigation = browser.find_element(By.CSS_SELECTOR, "nav.md-nav--primary").get_attribute("textContent") or ""
    for section in ("Engine integration", "Operations", "Runbooks", "Design", "Testing", "Benchmarks"):
        assert section in navigation
    shot = tmp_path / f"{(path.strip('/') or 'home').replace('/', '-')}.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")
