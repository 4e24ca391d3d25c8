"""The book's figures (plots.py, matplotlib) and static-page sliders (widgets.py, ipywidgets).

Import the module you need; `import attnlib` imports neither.
"""
