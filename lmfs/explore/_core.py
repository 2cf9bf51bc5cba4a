"""The machinery every explorer shares: a :class:`View` of one state and the :class:`Explorer` widget.

An explorer is a plain *update* function, ``controls' values -> View`` (HTML text, an optional
matplotlib figure, and the numbers behind them in ``values``), wrapped in an ipywidgets box whose
controls call it again whenever one moves. The update function is what the tests call; the widget
only shows its result. Figures are drawn on a bare :class:`matplotlib.figure.Figure` (no pyplot),
so building an explorer never opens a plot of its own in the notebook, and sent to the browser as
PNG bytes in an ``Image`` widget.

Headless (nbval, papermill, the book) the widget has no frontend; its display also carries a
``text/html`` rendering of its current view, which is what a notebook viewer without a kernel
shows. In JupyterLab the widget renders instead and follows its controls.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from typing import Callable

import ipywidgets as widgets
from matplotlib.figure import Figure


@dataclass
class View:
    """What an explorer shows for one setting of its controls.

    ``text``: HTML (a sentence, a small table); ``figure``: a matplotlib figure or None;
    ``values``: the numbers shown, by name, for tests and for reuse in a notebook.
    """

    text: str
    figure: Figure | None = None
    values: dict = field(default_factory=dict)

    def png(self) -> bytes:
        """The figure as PNG bytes (empty without a figure)."""
        if self.figure is None:
            return b""
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=80)
        return buffer.getvalue()


def new_figure(ncols: int = 1, size: tuple[float, float] = (6.4, 3.2)):
    """A pyplot-free figure with ``ncols`` axes side by side: ``(figure, axes)`` (one axes if ncols=1)."""
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(1, ncols)
    return fig, axes


def table(rows: dict, fmt: Callable[[object], str] | None = None) -> str:
    """A two-column HTML table of ``name -> value``; floats printed with 4 significant digits."""
    def show(v):
        if fmt is not None:
            return fmt(v)
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = "".join(f"<tr><td style='padding:0 1em 0 0'>{html.escape(str(k))}</td>"
                    f"<td style='text-align:right'>{html.escape(show(v))}</td></tr>" for k, v in rows.items())
    return f"<table style='font-family:monospace;font-size:90%'>{cells}</table>"


def gigabytes(n_bytes: float) -> str:
    """Bytes in readable units (decimal: GB = 1e9 bytes, as the datasheets count)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:.3g} {unit}"
    return f"{n_bytes:.0f} B"


class Explorer(widgets.VBox):
    """Controls above the text and figure of :attr:`update`'s view; recomputed on every change.

    ``controls``: ``name -> ipywidgets control`` whose values are passed to ``update`` by name
    (the first one is the control the browser test moves); ``fixed``: further keyword arguments
    for ``update`` that no control changes (the lecture's model, tokenizer, runs ...). An input
    ``update`` rejects with ``ValueError`` is shown as the error's message instead of a view.
    """

    def __init__(self, title: str, update: Callable[..., View], controls: dict[str, widgets.Widget],
                 fixed: dict | None = None):
        self.title, self.update, self.controls, self.fixed = title, update, dict(controls), dict(fixed or {})
        self.text = widgets.HTML()
        self.text.add_class("lmfs-explorer-text")
        self.image = widgets.Image(format="png")
        self.image.add_class("lmfs-explorer-image")
        for i, control in enumerate(self.controls.values()):
            control.style.description_width = "initial"
            control.add_class("lmfs-explorer-control")
            if i == 0:
                control.add_class("lmfs-explorer-primary")
        box = widgets.HBox(list(self.controls.values()), layout=widgets.Layout(flex_flow="row wrap"))
        super().__init__([widgets.HTML(f"<b>{html.escape(title)}</b>"), box, self.text, self.image])
        self.add_class("lmfs-explorer")
        self.view: View | None = None
        self.refresh()
        for control in self.controls.values():
            control.observe(self.refresh, names="value")

    def values(self) -> dict:
        """The controls' current values, by the names ``update`` takes."""
        return {name: control.value for name, control in self.controls.items()}

    def refresh(self, change=None) -> None:
        """Recompute the view from the controls and show it."""
        try:
            self.view = self.update(**self.values(), **self.fixed)
        except ValueError as err:
            self.view = None
            self.text.value = f"<span style='color:#b00'>{html.escape(str(err))}</span>"
            self.image.layout.display = "none"
            return
        png = self.view.png()   # rendered first, so that the text and the image reach the browser together
        self.text.value = self.view.text
        self.image.value = png
        self.image.layout.display = None if png else "none"

    def static_html(self) -> str:
        """The current view as self-contained HTML (the figure inlined as a PNG data URL)."""
        if self.view is None:
            return f"<b>{html.escape(self.title)}</b><br>{self.text.value}"
        png = self.view.png()
        image = (f"<br><img src='data:image/png;base64,{base64.b64encode(png).decode()}'>" if png else "")
        state = ", ".join(f"{k} = {v!r}" for k, v in self.values().items())
        return (f"<div><b>{html.escape(self.title)}</b> <i>({html.escape(state)}; move the controls in "
                f"JupyterLab)</i><br>{self.view.text}{image}</div>")

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is not None:
            bundle["text/html"] = self.static_html()
        return bundle


def slider(value, lo, hi, step=1, description="", integer=True, log=False, **kwargs):
    """An ``IntSlider``/``FloatSlider`` (``FloatLogSlider`` with ``log``: ``lo``/``hi`` are exponents
    of 10) that reports on release only, so a drag does one update, not dozens."""
    common = dict(value=value, step=step, description=description, continuous_update=False, **kwargs)
    if log:
        return widgets.FloatLogSlider(min=lo, max=hi, base=10, **common)
    cls = widgets.IntSlider if integer else widgets.FloatSlider
    return cls(min=lo, max=hi, **common)

