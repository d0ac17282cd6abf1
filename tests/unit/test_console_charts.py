"""The console's SVG charts: well-formed, scaled into the frame, labels escaped, empty data said."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from serving.console.charts import bar_chart, line_chart

SVG = "{http://www.w3.org/2000/svg}"


def parse(markup: str) -> ET.Element:
    return ET.fromstring(str(markup).replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1))


def test_a_line_chart_draws_each_series_inside_its_frame():
    svg = line_chart({"train": [(0, 0.1), (1, 0.2), (2, 0.4)], "held-out": [(0, 0.0), (2, None), (3, 0.3)]},
                     title="reward", x_label="version", y_label="mean", width=400, height=200)
    root = parse(svg)
    lines = root.findall(f"{SVG}polyline")
    dots = root.findall(f"{SVG}circle")
    assert len(lines) == 1 and len(dots) == 2  # held-out: a gap at version 2 leaves two single points
    for x, y in (map(float, p.split(",")) for p in lines[0].get("points").split()):
        assert 0 <= x <= 400 and 0 <= y <= 200
    assert {t.text for t in root.iter(f"{SVG}text")} >= {"reward", "version", "mean", "train", "held-out"}


def test_labels_are_escaped_and_empty_data_is_said():
    svg = line_chart({"<script>x</script>": [(0, 1.0)]}, title='a "b" <c>', x_label="&", y_label="y")
    assert "<script>" not in svg and "&lt;script&gt;" in svg and "&#34;b&#34;" in svg
    parse(svg)
    assert "no data yet" in line_chart({"a": []}, title="t", x_label="x", y_label="y")
    assert "no data yet" in bar_chart([], title="t", x_label="x", y_label="y")


def test_bars_scale_to_the_largest():
    root = parse(bar_chart([("0", 50.0), ("1", 25.0), ("<2>", 0.0)], title="staleness", x_label="behind",
                           y_label="samples", height=200))
    heights = [float(r.get("height")) for r in root.findall(f"{SVG}rect")]
    assert heights[0] == 2 * heights[1] and heights[2] == 0
    assert re.search(r"&lt;2&gt;", bar_chart([("<2>", 1.0)], title="t", x_label="x", y_label="y"))
