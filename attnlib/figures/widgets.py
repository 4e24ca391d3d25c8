"""Sliders that work on the static web page as well as in a live kernel.

Every view is rendered ahead of time, one per slider value, into an ipywidgets `Stack`
whose `selected_index` is linked in the browser (`jslink`) to the slider: no kernel is
needed to switch. In a live kernel the shown view is also recomputed on every move.
On ipywidgets 7 (Colab), which has no `Stack`, it falls back to a live `interact`.
"""

import ipywidgets as widgets
from IPython.display import HTML, Image, display


def _view(content):
    """A widget for one pre-rendered view: PNG bytes become an Image, a string becomes HTML."""
    if isinstance(content, (bytes, bytearray)):
        return widgets.Image(value=bytes(content), format="png")
    return widgets.HTML(value=content)


def _refresh(view, content):
    view.value = bytes(content) if isinstance(content, (bytes, bytearray)) else content


class Views(widgets.VBox):
    """A control above a stack of views; its text form is short and stable (nbval compares it)."""

    def __init__(self, summary, children):
        super().__init__(children)
        self.summary = summary

    def __repr__(self):
        return self.summary


def has_stack() -> bool:
    """ipywidgets 8 has Stack; Colab's ipywidgets 7 does not."""
    return hasattr(widgets, "Stack")


def slider_views(description, options, render, start=0):
    """A slider over `options` switching between views from `render(option)` (PNG or HTML).

    Returns a widget box: [slider, stack of views]. `start` is the index shown first.
    """
    options = list(options)
    if not has_stack():

        def show(option):
            content = render(option)
            display(Image(content) if isinstance(content, (bytes, bytearray)) else HTML(content))

        return widgets.interactive(
            show,
            option=widgets.SelectionSlider(
                options=options, value=options[start], description=description
            ),
        )
    views = [_view(render(option)) for option in options]
    slider = widgets.SelectionSlider(
        options=[str(option) for option in options],
        index=start,
        description=description,
        continuous_update=True,
        layout=widgets.Layout(width="420px"),
        style={"description_width": "initial"},
    )
    stack = widgets.Stack(children=views, selected_index=start)
    widgets.jslink((slider, "index"), (stack, "selected_index"))  # works with no kernel

    def recompute(change):  # live kernel only: recompute the view just selected
        _refresh(views[change["new"]], render(options[change["new"]]))

    slider.observe(recompute, names="index")
    return Views(f"slider '{description}' over {options}: {len(views)} views", [slider, stack])


def choice_views(description, choices, start=0):
    """Toggle buttons over `choices` (a dict label -> widget or content), switching views."""
    labels = list(choices)
    views = [c if isinstance(c, widgets.Widget) else _view(c) for c in choices.values()]
    if not has_stack():
        return widgets.interactive(
            lambda choice: display(views[labels.index(choice)]),
            choice=widgets.ToggleButtons(options=labels, value=labels[start]),
        )
    buttons = widgets.ToggleButtons(options=labels, index=start, description=description)
    stack = widgets.Stack(children=views, selected_index=start)
    widgets.jslink((buttons, "index"), (stack, "selected_index"))
    return Views(f"buttons '{description}' over {labels}: {len(views)} views", [buttons, stack])
