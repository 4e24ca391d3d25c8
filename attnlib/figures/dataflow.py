"""One attention layer as a data-flow picture: X -> Q, K, V -> scores Z -> weights A -> output.

Each matrix is drawn as a small heatmap of its actual values, one square per number, with its
name and shape; the arrows name the step (eq. 2.1, then eq. 2.2 taken apart). Nothing random is
drawn here: the picture is a function of the tensors it is given, so seeded tensors give the
same picture every time.
"""

import matplotlib.patches as patches

from attnlib.figures.plots import CMAP, plt

CELL = 0.42  # side of one number's square, in the drawing's units
SIGNED = "RdBu_r"  # projections and scores have both signs: blue below 0, red above


def _as_array(t):
    return t.detach().cpu().double().numpy() if hasattr(t, "detach") else t


def _check_shapes(X, Q, K, V, Z, A, out):
    """The shapes eq. 2.1 and 2.2 require, or a ValueError that names the first mismatch."""
    T, d_model = X.shape
    rules = [
        ("Q has one row per token of X", Q.shape[0] == T),
        ("K and V have one row per key", K.shape[0] == V.shape[0]),
        ("queries and keys share a width d_k", Q.shape[1] == K.shape[1]),
        ("the scores are [T, S]", tuple(Z.shape) == (Q.shape[0], K.shape[0])),
        ("the weights are the scores' shape", tuple(A.shape) == tuple(Z.shape)),
        ("the output is [T, d_v]", tuple(out.shape) == (Q.shape[0], V.shape[1])),
    ]
    for rule, holds in rules:
        if not holds:
            raise ValueError(f"data-flow shapes: {rule}")
    return T, d_model


def _matrix(ax, values, left, top, cmap, label, signed):
    """Draw values [rows, cols] with its top-left corner at (left, top); return its box."""
    values = _as_array(values)
    rows, cols = values.shape
    width, height = cols * CELL, rows * CELL
    if signed:
        edge = float(abs(values).max()) or 1.0
        vmin, vmax = -edge, edge
    else:
        vmin, vmax = 0.0, max(float(values.max()), 1e-12)
    ax.imshow(
        values,
        cmap=cmap,
        vmin=vmin,
        vmax=vmax,
        extent=(left, left + width, top - height, top),
        interpolation="nearest",
    )
    ax.add_patch(patches.Rectangle((left, top - height), width, height, fill=False, lw=0.8))
    ax.text(left + width / 2, top + 0.25, label, ha="center", va="bottom", fontsize=9)
    return left, top - height, width, height


def _arrow(ax, start, end, text="", offset=(0.0, 0.25)):
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops={"arrowstyle": "->", "lw": 1.0, "color": "0.25"},
    )
    if text:
        middle = ((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1])
        ax.text(*middle, text, ha="center", va="bottom", fontsize=8, color="0.15")


def _projections(ax, X, Q, K, V):
    """Column 1: X [T, d_model]; column 2: Q [T, d_k], K [S, d_k] and V [S, d_v], stacked,
    each with an arrow from X and its weight's shape. Returns X's box and the boxes by name."""
    (T, d_model), S, d_k, d_v = X.shape, K.shape[0], Q.shape[1], V.shape[1]
    tall = max(T, S) * CELL
    gap = 1.6
    centre = -(3 * tall + 2 * gap) / 2
    x_box = _matrix(ax, X, 0.0, centre + T * CELL / 2, SIGNED, f"X\n[{T}, {d_model}]", True)
    col2 = x_box[0] + x_box[2] + 2.6
    names = [
        ("Q", Q, f"$Q = XW_Q$\n[{T}, {d_k}]", f"$W_Q$ [{d_model}, {d_k}]"),
        ("K", K, f"$K = XW_K$\n[{S}, {d_k}]", f"$W_K$ [{d_model}, {d_k}]"),
        ("V", V, f"$V = XW_V$\n[{S}, {d_v}]", f"$W_V$ [{d_model}, {d_v}]"),
    ]
    boxes = {}
    for row, (name, values, label, weight) in enumerate(names):
        top = -row * (tall + gap)
        boxes[name] = _matrix(ax, values, col2, top, SIGNED, label, True)
        x_mid = x_box[1] + x_box[3] / 2
        box = boxes[name]
        _arrow(ax, (x_box[0] + x_box[2] + 0.1, x_mid), (col2 - 0.1, box[1] + box[3] / 2))
        ax.text(
            col2 - 0.2,
            box[1] + box[3] / 2 - 0.2,
            weight,
            ha="right",
            va="top",
            fontsize=8,
            color="0.15",
        )
    return x_box, boxes


def _scores_and_weights(ax, Z, A, q_box, k_box, col3):
    """Column 3: the scores Z [T, S], with arrows from Q and K; column 4: the weights A [T, S].
    Returns the boxes of Z and A."""
    T, S = Z.shape
    z_top = (q_box[1] + k_box[1] + k_box[3]) / 2 + Z.shape[0] * CELL / 2
    z_box = _matrix(
        ax, Z, col3, z_top, SIGNED, f"scores $Z = QK^T/\\sqrt{{d_k}}$\n[{T}, {S}]", True
    )
    z_mid = z_box[1] + z_box[3] / 2
    for box in (q_box, k_box):
        _arrow(ax, (box[0] + box[2] + 0.1, box[1] + box[3] / 2), (col3 - 0.1, z_mid))
    col4 = col3 + z_box[2] + 2.6
    a_box = _matrix(ax, A, col4, z_top, CMAP, f"weights $A$\n[{T}, {S}]", False)
    _arrow(ax, (col3 + z_box[2] + 0.1, z_mid), (col4 - 0.1, z_mid), "softmax\nof each row")
    return z_box, a_box


def _output(ax, out, a_box, v_box, z_mid):
    """Column 5: the output AV [T, d_v], with arrows from A (at height z_mid) and V.
    Returns its box."""
    T, d_v = out.shape
    col5 = a_box[0] + a_box[2] + 2.6
    o_top = (a_box[1] + v_box[1] + v_box[3]) / 2 + out.shape[0] * CELL / 2
    o_box = _matrix(ax, out, col5, o_top, SIGNED, f"output $AV$\n[{T}, {d_v}]", True)
    o_mid = o_box[1] + o_box[3] / 2
    _arrow(ax, (a_box[0] + a_box[2] + 0.1, z_mid), (col5 - 0.1, o_mid))
    _arrow(ax, (v_box[0] + v_box[2] + 0.1, v_box[1] + v_box[3] / 2), (col5 - 0.1, o_mid))
    ax.text(
        col5 - 1.3,
        o_mid - 1.0,
        "A mixes\nthe rows of V",
        ha="center",
        va="top",
        fontsize=8,
        color="0.15",
    )
    return o_box


def _token_labels(ax, token_labels, x_box, T):
    """Write the first T token labels left of X's rows."""
    for i, word in enumerate(token_labels[:T]):
        ax.text(
            -0.1,
            x_box[1] + x_box[3] - (i + 0.5) * CELL,
            word,
            ha="right",
            va="center",
            fontsize=8,
        )


def dataflow(X, Q, K, V, Z, A, out, token_labels=None, ax=None):
    """Draw eq. 2.1 and 2.2 as a data flow, with every matrix's values and shape.

    X [T, d_model] is projected to Q [T, d_k], K [S, d_k] and V [S, d_v] (eq. 2.1); the scores
    Z = Q K^T / sqrt(d_k) are [T, S], the weights A = softmax over each row of Z are [T, S],
    and the output A V is [T, d_v] (eq. 2.2). Returns the Axes.
    """
    T, _ = _check_shapes(X, Q, K, V, Z, A, out)
    if ax is None:
        _, ax = plt.subplots(figsize=(10.0, 4.6))
    x_box, boxes = _projections(ax, X, Q, K, V)
    col3 = boxes["Q"][0] + max(Q.shape[1], V.shape[1]) * CELL + 2.0
    z_box, a_box = _scores_and_weights(ax, Z, A, boxes["Q"], boxes["K"], col3)
    o_box = _output(ax, out, a_box, boxes["V"], z_box[1] + z_box[3] / 2)
    if token_labels is not None:
        _token_labels(ax, token_labels, x_box, T)
    ax.set_xlim(-1.6 if token_labels is not None else -0.3, o_box[0] + o_box[2] + 0.3)
    ax.set_ylim(boxes["V"][1] - 0.4, 1.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        "one attention layer: every matrix drawn with its values (blue < 0 < red) and shape",
        fontsize=10,
    )
    return ax
