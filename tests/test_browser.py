"""The built book in a real browser with no network: math, figures, sliders, Colab links.

Serves the built site on 127.0.0.1 and opens every page of the table of contents in Debian's
Chromium (driven by Playwright; no browser is ever downloaded). Any request that leaves the
site is blocked and fails the test. `make test` builds the book first (`make book`).
BOOK_SRC and BOOK_HTML point the test at another book source and its build.
"""

import functools
import http.server
import json
import os
import re
import subprocess
import threading
from pathlib import Path

import pytest
import yaml
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parent.parent
SRC = Path(os.environ.get("BOOK_SRC", REPO))
HTML = Path(os.environ.get("BOOK_HTML", SRC / "_build" / "html"))
SHOTS = HTML.parent / "screenshots"
CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
SLIDER_PAGES = {  # pages and the sliders each must show
    "notebooks/03_scaling": 1,
    "notebooks/05_causal_masking": 1,
    "notebooks/08_rotary_positions": 1,
    "notebooks/14_tiling": 1,
    "notebooks/18_induction_heads": 1,
    "notebooks/19_language_model": 1,
    "notebooks/20_circuits": 1,
    "notebooks/22_ring_attention": 1,
    "notebooks/23_latent_attention": 1,
    "notebooks/24_long_context": 1,
    "notebooks/25_linear_attention": 1,
}
TOGGLE_PAGES = {"notebooks/05_causal_masking": 1}  # toggle-button groups needed
RAW_TEX = re.compile(r"\$\$|\\\(|\\\)|\\\[|\\\]|\\begin\{|\\frac\{|\\sqrt\{")
UNTYPESET = "span.math:not(:has(mjx-container)), div.math:not(:has(mjx-container))"
RENDERED = ".widget-subarea > .jupyter-widgets"
REPORT = {}  # page -> what was checked; written next to the screenshots
# Code and outputs that scroll sideways: every code block, cell input or output element that
# shows a horizontal scrollbar (overflow-x auto or scroll, and wider content than its box).
SIDEWAYS = """() => Array.from(document.querySelectorAll(
    'main pre, main .cell_input *, main .cell_output *, main div.highlight'))
  .filter(e => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX)
    && e.scrollWidth > e.clientWidth + 1)
  .map(e => `${e.scrollWidth} > ${e.clientWidth} px: `
    + (e.innerText.split('\\n').find(l => l.length > 80) || e.innerText).trim().slice(0, 60))"""
# Display equations wider than the text column: MathJax lays a tagged one out as a full-width
# table and the part that does not fit is cut off at the left, unreadable and unscrollable.
WIDE_MATH = """() => Array.from(document.querySelectorAll('main mjx-container[display="true"]'))
  .filter(e => e.firstElementChild && e.firstElementChild.getBoundingClientRect().width
    > e.parentElement.getBoundingClientRect().width + 1)
  .map(e => e.textContent.slice(0, 60))"""


def toc_pages():
    """Every page of _toc.yml, as a path without suffix (book/intro, notebooks/03_scaling)."""
    toc = yaml.safe_load((SRC / "_toc.yml").read_text())
    pages = [toc["root"]]
    for part in toc.get("parts", []):
        pages += [chapter["file"] for chapter in part["chapters"]]
    return [str(Path(page).with_suffix("")) for page in pages]


def colab_url(page):
    """The Colab URL of a chapter's notebook, from `repository.url` in _config.yml."""
    config = yaml.safe_load((SRC / "_config.yml").read_text())
    org_repo = config["repository"]["url"].removeprefix("https://github.com/").strip("/")
    branch = config["repository"].get("branch", "main")
    return f"https://colab.research.google.com/github/{org_repo}/blob/{branch}/{page}.ipynb"


def is_placeholder(page):
    """A chapter not written yet: its notebook is a single markdown cell 'To be written.'."""
    path = SRC / f"{page}.ipynb"
    if not path.exists():
        return False
    cells = json.loads(path.read_text())["cells"]
    return len(cells) == 1 and "To be written." in "".join(cells[0]["source"])


class Site(http.server.ThreadingHTTPServer):
    """The built book on a random local port; records every response it sends with an error."""

    def __init__(self):
        self.errors = []
        handler = functools.partial(Handler, directory=str(HTML))
        super().__init__(("127.0.0.1", 0), handler)
        self.origin = f"http://127.0.0.1:{self.server_port}"


class Handler(http.server.SimpleHTTPRequestHandler):
    def log_request(self, code="-", size="-"):
        if str(getattr(code, "value", code)).isdigit() and int(code) >= 400:
            self.server.errors.append(f"{int(code)} {self.path}")

    def log_message(self, format, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def site():
    if "BOOK_HTML" not in os.environ and "BOOK_SRC" not in os.environ:
        # The book must be built and current: `make -q` answers 0 only if nothing changed.
        stamp = subprocess.run(["make", "-q", "_build/.book-built"], cwd=REPO).returncode
        if stamp != 0:
            pytest.fail("the built book is missing or out of date: run `make book` first")
    if not (HTML / "index.html").exists():
        pytest.fail(f"no built book at {HTML}: run `make book` first")
    server = Site()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()
    SHOTS.mkdir(parents=True, exist_ok=True)
    (SHOTS / "report.json").write_text(json.dumps(REPORT, indent=2) + "\n")


@pytest.fixture(scope="module")
def browser():
    if os.environ.get("BROWSER") == "skip":
        pytest.skip("BROWSER=skip: the browser tests were skipped on request")
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: apt-get install chromium chromium-driver "
            "(or BROWSER=skip to skip the browser tests)"
        )
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield chromium
        chromium.close()


def wait_quietly(page, condition, arg=None):
    """Wait for a condition; if it never holds, carry on: the assertions say what is wrong."""
    try:
        page.wait_for_function(condition, arg=arg)
    except PlaywrightTimeout:
        pass


class Visit:
    """One page opened in a fresh browser context, with everything that went wrong recorded."""

    def __init__(self, browser, site, page):
        self.site, self.problems, self.blocked = site, [], []
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.page = self.context.new_page()
        self.page.set_default_timeout(20_000)
        self.context.route("**/*", self.route)
        self.page.on("console", self.console)
        self.page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        self.page.on("requestfailed", self.failed)
        self.page.on("response", self.response)
        site.errors.clear()
        self.page.goto(f"{site.origin}/{page}.html", wait_until="load")

    def route(self, route):
        if route.request.url.startswith(self.site.origin + "/"):
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort("blockedbyclient")

    def console(self, message):
        if message.type == "error":
            self.problems.append(f"console error: {message.text} at {message.location}")

    def failed(self, request):
        if request.url not in self.blocked:
            self.problems.append(f"request failed: {request.url} ({request.failure})")

    def response(self, response):
        if response.status >= 400:
            self.problems.append(f"HTTP {response.status}: {response.url}")

    def settle(self):
        """Wait until MathJax has typeset, every widget view is rendered and images are loaded.

        Returns (widget views on the page, widget views rendered)."""
        page = self.page
        wait_quietly(page, f"() => document.querySelectorAll('{UNTYPESET}').length === 0")
        page.evaluate("async () => window.MathJax?.startup?.promise && MathJax.startup.promise")
        views = page.locator('script[type="application/vnd.jupyter.widget-view+json"]').count()
        wait_quietly(page, f"n => document.querySelectorAll('{RENDERED}').length >= n", views)
        wait_quietly(page, "() => Array.from(document.images).every(i => i.complete)")
        page.wait_for_load_state("networkidle")
        return views, page.locator(RENDERED).count()

    def close(self):
        self.context.close()


@pytest.fixture
def visit(browser, site):
    visits = []

    def open_page(page):
        visits.append(Visit(browser, site, page))
        return visits[-1]

    yield open_page
    for v in visits:
        v.close()


# What a widget view box shows now: the stack's HTML text, or a hash of its image's bytes.
SHOWN = """box => (async () => {
  const stack = box.children[1];
  const img = stack.querySelector('img');
  if (img) {
    await img.decode().catch(() => null);
    const bytes = await (await fetch(img.src)).arrayBuffer();
    const hash = Array.from(new Uint8Array(await crypto.subtle.digest('SHA-256', bytes)))
      .slice(0, 6).map(b => b.toString(16).padStart(2, '0')).join('');
    return `image ${img.naturalWidth}x${img.naturalHeight} sha256 ${hash}`;
  }
  return 'html ' + stack.innerText.replace(/\\s+/g, ' ').trim().slice(0, 120);
})()"""


def move(visit, box, kind):
    """Move a slider one step, or click another toggle button: (control moved, before, after)."""
    page = visit.page
    before = box.evaluate(SHOWN)
    if kind == "slider":
        handle = box.locator(".noUi-handle").first
        readout = box.locator(".widget-readout").first
        start = readout.inner_text()
        at_end = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
        handle.focus()
        page.keyboard.press("ArrowLeft" if at_end else "ArrowRight")
        control = f"{start} -> {readout.inner_text()}"
    else:
        button = box.locator(".widget-toggle-button:not(.mod-active)").first
        start = box.locator(".widget-toggle-button.mod-active").first.inner_text()
        control = f"{start} -> {button.inner_text()}"
        button.click()
    for _ in range(50):  # the new view is shown at once; allow up to 5 s for it to paint
        after = box.evaluate(SHOWN)
        if after != before:
            break
        page.wait_for_timeout(100)
    return control, before, after


@pytest.mark.parametrize("page", toc_pages())
def test_page(visit, page):
    v = visit(page)
    views, rendered = v.settle()
    p = v.page
    if page.startswith("notebooks/"):  # the artefact, taken before anything is checked
        SHOTS.mkdir(parents=True, exist_ok=True)
        p.screenshot(path=str(SHOTS / f"{Path(page).name}.png"), full_page=True)
    report = REPORT.setdefault(page, {})
    failures = report.setdefault("failures", [])  # every check runs; all failures are listed

    def check(ok, message):
        if not ok:
            failures.append(message)

    # Math: every math element typeset by MathJax, no TeX error, no raw TeX left in the text.
    math = p.locator("span.math, div.math").count()
    untypeset = p.locator(UNTYPESET).count()
    check(untypeset == 0, f"{untypeset} of {math} math elements not typeset")
    tex_errors = p.evaluate(
        """() => Array.from(window.MathJax?.startup?.document?.math || [])
        .filter(m => m.typesetRoot?.querySelector('mjx-merror'))
        .map(m => [m.typesetRoot.querySelector('mjx-merror').getAttribute('data-mjx-error'),
                   m.math])"""
    )
    check(
        p.locator("mjx-merror").count() == 0,
        f"TeX errors: {[f'{e} in {tex!r}' for e, tex in tex_errors]}",
    )
    text = p.evaluate(
        """() => { const main = document.querySelector('main') || document.body;
        const copy = main.cloneNode(true);
        copy.querySelectorAll('pre, code, script, style, mjx-container, .highlight')
            .forEach(e => e.remove());
        return copy.textContent; }"""
    )
    raw = sorted(set(RAW_TEX.findall(text)))
    check(not raw, f"raw TeX left in the page: {raw}")

    # Figures: every image on the page loaded.
    images = p.evaluate(
        "() => Array.from(document.images).map(i => [i.getAttribute('src'), i.naturalWidth])"
    )
    broken = [src[:80] for src, width in images if width == 0]
    check(not broken, f"images that did not load: {broken}")
    report.update(math=math, images=len(images), widget_views=views)

    # Code fits the page: at 1280 px no code cell, output or code block scrolls sideways.
    sideways = p.evaluate(SIDEWAYS)
    check(not sideways, f"code or output that scrolls sideways at 1280 px: {sideways}")
    wide_math = p.evaluate(WIDE_MATH)
    check(not wide_math, f"display equations wider than the column at 1280 px: {wide_math}")

    # Colab: the text link and the launch button both open this very notebook.
    if page.startswith("notebooks/"):
        links = p.evaluate(
            """() => Array.from(document.querySelectorAll('a[href*="colab.research.google.com"]'))
            .map(a => [a.textContent.trim(), a.getAttribute('href'),
                a.getAttribute('title') || a.getAttribute('data-bs-original-title') || ''])"""
        )
        expected = colab_url(page)
        wrong = [href for _, href, _ in links if href != expected]
        check(not wrong, f"Colab links to another notebook: {wrong} (expected {expected})")
        check(any(title == "Launch on Colab" for *_, title in links), "no Colab launch button")
        if not is_placeholder(page):
            check(any(text == "Open in Colab" for text, *_ in links), "no 'Open in Colab' link")
        report["colab"] = [f"{text or title}: {href}" for text, href, title in links]

    # Answers: every folded answer starts closed, its code hidden, and opens on a click.
    if page.startswith("notebooks/") and not is_placeholder(page):
        answers_js = """() => Array.from(document.querySelectorAll('main details'))
            .filter(d => d.querySelector(':scope > summary')?.innerText.trim() === 'Answer')
            .map(d => [d.open, Array.from(d.querySelectorAll('pre'))
                .some(e => e.checkVisibility())])"""
        shut = p.evaluate(answers_js)
        check(len(shut) >= 2, f"only {len(shut)} folded answers")
        check(all(not o and not v for o, v in shut), f"answers open or showing code: {shut}")
        p.locator("main details > summary", has_text="Answer").first.click()
        opened = p.evaluate(answers_js)[:1]
        check(opened == [[True, True]], f"the first answer does not open on a click: {opened}")
        report["answers"] = len(shut)

    # Widgets: all rendered; every slider and every toggle group switches what its box shows.
    check(rendered >= views, f"only {rendered} of {views} widget views rendered")
    changes = report.setdefault("changes", [])
    for kind, selector in (("slider", ".widget-slider"), ("toggle", ".widget-toggle-buttons")):
        boxes = p.locator(f".widget-vbox:has(> {selector} + .widget-box)")
        for i in range(boxes.count()):
            box = boxes.nth(i)
            box.scroll_into_view_if_needed()
            label = box.locator(f"{selector} .widget-label").first.inner_text()
            shot = SHOTS / f"{Path(page).name}-{kind}{i + 1}"
            box.screenshot(path=f"{shot}-before.png")
            control, before, after = move(v, box, kind)
            box.screenshot(path=f"{shot}-after.png")
            changes.append(f"{kind} {label!r} {control}: {before} => {after}")
            check(after != before, f"{kind} {label!r} ({control}) did not change the view")
            check(" 0x" not in after, f"{kind} {label!r}: the new image did not load")
    if not is_placeholder(page):
        for kind, needed in (("slider", SLIDER_PAGES), ("toggle", TOGGLE_PAGES)):
            found = sum(change.startswith(kind) for change in changes)
            n = needed.get(page, 0)
            check(found >= n, f"needs {n} {kind}(s) that switch the view; found {found}")

    # Nothing from outside the site, no failed request, no console error, no error response,
    # from loading the page to the last slider move.
    report.update(blocked=v.blocked, problems=v.problems + v.site.errors)
    check(not v.blocked, f"requests outside the site: {v.blocked}")
    failures += v.problems
    check(not v.site.errors, f"the site answered with errors: {v.site.errors}")
    if failures:
        pytest.fail(f"{page}:\n" + "\n".join(failures), pytrace=False)


def test_the_sideways_check_catches_a_planted_long_line(visit):
    v = visit("notebooks/05_causal_masking")
    v.settle()
    before = v.page.evaluate(SIDEWAYS)
    planted = "x = 1  # " + "a long comment " * 8
    v.page.evaluate(
        "line => { const pre = document.querySelector('.cell_input pre');"
        " pre.textContent += '\\n' + line; }",
        planted,
    )
    found = v.page.evaluate(SIDEWAYS)
    assert len(found) > len(before) and any(planted[:40] in line for line in found), found


def test_index_redirects_within_the_site(visit):
    v = visit("index")
    v.page.wait_for_url(re.compile(r"/book/intro\.html$"))
    v.settle()
    assert not v.blocked and not v.problems and not v.site.errors


def test_the_exercise_index_links_resolve():
    """Every link of the exercise index lands on a heading id of the built chapter."""
    index = (HTML / "book" / "exercises.html").read_text()
    links = re.findall(r'href="\.\./notebooks/([\w.]+\.html)#([\w-]+)"', index)
    assert len(links) >= 60, len(links)
    pages = {}
    for name, anchor in links:
        html = pages.setdefault(name, (HTML / "notebooks" / name).read_text())
        assert f'id="{anchor}"' in html, f"{name}#{anchor} has no target"
