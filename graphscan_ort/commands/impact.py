"""impact: which operator's quantization costs the output, and what to exclude.

One derived model answers every "what if X stayed float" question: the
quantized model with Where(on, alternative, DQ(Q(t))) on exactly the edges a
variant changes, each Where with its own boolean input. It runs as a chain of
segment sessions (segments.py); no session per variant.
"""

from __future__ import annotations

import textwrap
from typing import Any

from graphscan import (
    TABLE_WIDTH,
    Command,
    OnlyWith,
    Samples,
    finite_float,
    format_fields,
    format_names,
    load_with_weights,
    non_negative_int,
    page,
    section,
    visible,
)
from graphscan_ort.engines.attribution import measure
from graphscan_ort.shared.answers import ImpactAnswer
from graphscan_ort.shared.inputs import check_same_inputs, inputs_answer, model_samples, parse_shapes
from graphscan_ort.shared.options import Named, finite_non_negative
from graphscan_ort.shared.sessions import inputs_hint
from graphscan_ort.shared.tables import RED_FLAGS, input_fields, largest_first

IMPACT_SYMBOLIC_DIM_SIZE = 1


def impact(
    a: str,
    b: str,
    samples: Samples,
    target_sqnr: float | None,
    max_exclude: int | None,
    top: int | None,
    min_gain: float | None,
) -> ImpactAnswer:
    """Per operator and per activation tensor of ``b`` (quantized): the output
    SQNR against ``a`` (float) if it stayed float; optionally what to exclude."""
    with inputs_hint(not samples.inputs, IMPACT_SYMBOLIC_DIM_SIZE, [a, b]):
        reference, candidate = Named(load_with_weights(a), a), Named(load_with_weights(b), b)
        check_same_inputs(reference, candidate)
        shapes = parse_shapes(samples.shape)
        chosen, defaulted = model_samples(
            reference.model, samples.inputs, shapes, samples.seed, IMPACT_SYMBOLIC_DIM_SIZE
        )
        body = measure(reference, candidate, chosen, target_sqnr, max_exclude, top, min_gain)
    return {"a": a, "b": b, "inputs": inputs_answer(chosen), "defaulted": defaulted, **body}


def impact_table(answer: dict[str, Any], top: int | None) -> str:
    """Ops and tensors in the answer's order (largest gain first), and the exclusion found."""
    head = format_fields(
        [("a", answer["a"]), ("b", answer["b"])]
        + input_fields(answer["inputs"], answer.get("defaulted"))
        + [("samples", answer["samples"]), ("output_sqnr_db", answer["output_sqnr_db"])]
        + ([("deployed", answer["deployed_output_sqnr_db"])] if "deployed_output_sqnr_db" in answer else [])
        + ([("weights matched", "{matched} of {total}".format(**answer["weights"]))] if "weights" in answer else [])
    )
    warnings_seen = [f"warning: {textwrap.fill(visible(w), TABLE_WIDTH - 9)}" for w in answer.get("warnings", [])]
    head = "\n".join([head, *(w.replace("\n", "\n         ") for w in warnings_seen)])
    ops = [[r["node"], r["op_type"], r["sqnr_db"], r["gain_db"]] for r in answer["ops"]]
    tensors = [
        [r["tensor"], r["producer"], r["gain_db"], r["rounding_gain_db"], r["clipped"]] for r in answer["tensors"]
    ]
    clipped = [
        [r["tensor"], r["producer"], r["gain_db"], r["rounding_gain_db"], r["clipped"]]
        for r in largest_first(answer["tensors"], "clipped")
        if r["clipped"] > 0
    ]
    blocks = [
        head,
        # A tensor whose values fall outside its Q's range leads: its gain may be small, the range wrong.
        section(
            "tensors by clipped share, largest first",
            ["tensor", "producer", "gain_db", "rounding", "clipped"],
            clipped,
            top or RED_FLAGS,
        ),
        section("ops by output gain when kept float", ["node", "op_type", "sqnr_db", "gain_db"], ops, top),
        section(
            "tensors by output gain when kept float",
            ["tensor", "producer", "gain_db", "rounding", "clipped"],
            tensors,
            top,
        ),
    ]
    exclude = answer.get("exclude")
    if exclude is not None:
        blocks.append(
            format_fields([(key, exclude[key]) for key in ("target_sqnr_db", "sqnr_db", "reached")])
            + "\nkept float in graphscan's variant, inputs fed float (the quantizer's\n"
            + "nodes_to_exclude keeps Q->DQ on them: measure its model before trusting this):\n"
            + format_names(exclude["nodes"])
        )
    return page(*blocks)


COMMAND = Command(
    "impact",
    impact,
    ("a", "b"),
    options=(
        Samples.taken(IMPACT_SYMBOLIC_DIM_SIZE, many=True),
        (
            "--target-sqnr",
            {"metavar": "DB", "type": finite_float, "help": "find the nodes to exclude to reach this output SQNR"},
        ),
        (
            "--max-exclude",
            {"metavar": "N", "type": non_negative_int, "help": "at most N excluded nodes (with --target-sqnr)"},
        ),
        (
            "--min-gain",
            {
                "metavar": "DB",
                "type": finite_non_negative,
                "help": "with --target-sqnr: add no operator whose gain is below DB (default: 0.01)",
            },
        ),
        (
            "--top",
            {
                "metavar": "N",
                "type": non_negative_int,
                "help": "list only the first N ops and tensors (all are measured)",
            },
        ),
    ),
    only_with=(OnlyWith("--target-sqnr", lambda built: built["target_sqnr"] is not None, ("max_exclude", "min_gain")),),
    table=impact_table,
    answer=ImpactAnswer,
)
