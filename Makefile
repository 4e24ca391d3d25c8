# Two commands on a fresh machine: `make book` and `make test`. Each sets itself up.
PYTHON ?= python3
NPM ?= npm
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip's index warnings about missing local mirrors are noise on this machine.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
QUIET := 2>&1 | { grep -v "^WARNING: Location" || true; }

# The page scripts, bundled into the site so that a page loads nothing from outside it.
# html-manager 1.0.15 is the embed bundle of ipywidgets 8.1.9 (jupyterlab-manager 5.0.16):
# both build on @jupyter-widgets/controls ^5.0.13 and base ^6.0.12.
REQUIREJS_VERSION := 2.3.8
HTML_MANAGER_VERSION := 1.0.15
MATHJAX_VERSION := 3.2.2
ASSETS := _assets
ASSETS_STAMP := $(ASSETS)/.fetched-$(REQUIREJS_VERSION)-$(HTML_MANAGER_VERSION)-$(MATHJAX_VERSION)
# The html-manager's icon fonts are requested relative to the page that shows a widget.
WIDGET_FONTS := extra/notebooks/@jupyter-widgets/html-manager/dist

# The book is rebuilt (--all: a fresh Sphinx environment; a notebook whose code is unchanged comes
# from the execution cache) when anything it is made of changes; otherwise `make book` does nothing.
BOOK_STAMP := _build/.book-built
BOOK_INPUTS := _config.yml _toc.yml $(wildcard book/*.md book/css/* notebooks/*.ipynb attnlib/*.py \
  attnlib/*/*.py attnlib/*/*/*.py attnlib/csrc/*)

# A second environment with Colab-like versions (constraints-colab.txt), for `make test-colab`.
COLAB_VENV := .venv-colab
COLAB_STAMP := $(COLAB_VENV)/.installed

.PHONY: setup assets book test test-portable test-colab lint lab clean execute browser

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt $(QUIET)
	$(PY) -m pip install -q --no-deps -e . $(QUIET)
	$(PY) -c "import attnlib, torch; assert torch.__version__.startswith('2.13.0')"
	touch $@

# Fetched from the npm registry with `npm pack` (no dependencies installed), never committed.
assets: $(ASSETS_STAMP)

$(ASSETS_STAMP):
	rm -rf $(ASSETS).tmp && mkdir -p $(ASSETS).tmp/npm $(ASSETS).tmp/static/widgets \
	  $(ASSETS).tmp/$(WIDGET_FONTS)
	cd $(ASSETS).tmp/npm && $(NPM) pack --silent requirejs@$(REQUIREJS_VERSION) \
	  @jupyter-widgets/html-manager@$(HTML_MANAGER_VERSION) mathjax@$(MATHJAX_VERSION) >/dev/null
	cd $(ASSETS).tmp/npm && for t in *.tgz; do mkdir "$${t%.tgz}" && \
	  tar -xzf "$$t" -C "$${t%.tgz}" --strip-components=1; done
	cp $(ASSETS).tmp/npm/requirejs-*/require.js $(ASSETS).tmp/static/widgets/
	cp $(ASSETS).tmp/npm/jupyter-widgets-html-manager-*/dist/embed-amd.js \
	  $(ASSETS).tmp/static/widgets/
	cp $(ASSETS).tmp/npm/jupyter-widgets-html-manager-*/dist/*.{woff2,woff,ttf,eot} \
	  $(ASSETS).tmp/$(WIDGET_FONTS)/
	cp -r $(ASSETS).tmp/npm/mathjax-*/es5 $(ASSETS).tmp/static/mathjax
	cd $(ASSETS).tmp/static/mathjax && rm -f latest.js node-main.js mml-*.js tex-svg*.js \
	  tex-chtml*.js tex-mml-svg.js
	# A page without an icon link makes the browser fetch /favicon.ico, outside a Pages site.
	printf '%s' '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16"' \
	  ' height="16" rx="3" fill="#1f4e79"/><text x="8" y="12.5" font-size="12" fill="#fff"' \
	  ' text-anchor="middle" font-family="serif">A</text></svg>' > $(ASSETS).tmp/favicon.svg
	rm -rf $(ASSETS).tmp/npm $(ASSETS) && mv $(ASSETS).tmp $(ASSETS)
	touch $@

book: $(BOOK_STAMP)

$(BOOK_STAMP): $(STAMP) $(ASSETS_STAMP) $(BOOK_INPUTS)
	rm -f $@
	$(VENV)/bin/jupyter-book build --all . -W --keep-going
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check attnlib tests notebooks
	$(VENV)/bin/ruff format --check attnlib tests notebooks

# The browser tests need Debian's Chromium. `make test` finds it, installs it as root on
# Debian, or stops with the command to run; `make test BROWSER=skip` skips them, and says so.
BROWSER ?=
export BROWSER
browser:
	@if [ "$(BROWSER)" = skip ]; then \
	  echo "BROWSER=skip: the browser tests will be skipped"; \
	elif [ -x /usr/bin/chromium ]; then \
	  true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "Chromium is missing: installing Debian's chromium chromium-driver"; \
	  apt-get update -q && apt-get install -y -q chromium chromium-driver; \
	else \
	  echo "Chromium is missing. Install it with:"; \
	  echo "  sudo apt-get install chromium chromium-driver"; \
	  echo "or run 'make test BROWSER=skip' to skip the browser tests."; \
	  exit 1; \
	fi

# The browser tests (tests/test_browser.py) check the built book, so the book comes first.
# pytest runs last, so that its summary closes the output.
test: lint browser book
	$(PY) -m pytest

# Every chapter's stored outputs must also hold where MKL picks other kernels, as on another
# CPU: strict nbval under MKL's reproducible mode and under AVX2 kernels only. CI runs it.
NOTEBOOK_VARIANTS := MKL_CBWR=COMPATIBLE MKL_ENABLE_INSTRUCTIONS=AVX2
test-portable: setup
	for variant in $(NOTEBOOK_VARIANTS); do \
	  echo "nbval under $$variant"; \
	  env $$variant $(PY) -m pytest -q --tb=short notebooks; \
	done

$(COLAB_STAMP): constraints-colab.txt pyproject.toml
	test -x $(COLAB_VENV)/bin/python || $(PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/python -m pip install -q -c constraints-colab.txt -e ".[book,triton]" \
	  nbclient ipykernel $(QUIET)
	touch $@

# Every notebook top to bottom under Colab's versions; outputs are not compared (nbval does that
# under the pinned versions). The kernel finds `python` on PATH, so the venv's bin comes first.
test-colab: $(COLAB_STAMP)
	$(COLAB_VENV)/bin/python -c "import ipywidgets, transformers; \
	  print('ipywidgets', ipywidgets.__version__, 'transformers', transformers.__version__)"
	for notebook in notebooks/*.ipynb; do \
	  echo "$$notebook"; \
	  PATH="$(CURDIR)/$(COLAB_VENV)/bin:$$PATH" $(COLAB_VENV)/bin/jupyter-execute \
	    --timeout=300 "$$notebook" 2>&1 | { grep -v "^\[NbClientApp\]" || true; }; \
	done

# Re-execute chapters in place, storing their outputs (make execute NB="notebooks/05_*.ipynb").
execute: $(STAMP)
	for notebook in $(NB); do \
	  echo "$$notebook"; \
	  PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/jupyter-execute --inplace --timeout=600 \
	    "$$notebook" 2>&1 | { grep -v "^\[NbClientApp\]" || true; }; \
	done

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks

clean:
	rm -rf _build $(ASSETS) $(ASSETS).tmp $(COLAB_VENV)
