"""The HTML report's stylesheet and its table-sorting script, inlined into the page so that it opens offline."""

from __future__ import annotations


SORT_JS = """
document.querySelectorAll('table.sortable th').forEach((th, col) => th.addEventListener('click', () => {
  const body = th.closest('table').tBodies[0];
  const asc = th.dataset.asc !== '1'; th.dataset.asc = asc ? '1' : '0';
  const key = td => td.dataset.sort !== undefined ? parseFloat(td.dataset.sort) : td.textContent;
  [...body.rows].sort((a, b) => {
    const x = key(a.cells[col]), y = key(b.cells[col]);
    return (x < y ? -1 : x > y ? 1 : 0) * (asc ? 1 : -1);
  }).forEach(r => body.appendChild(r));
}));
"""

CSS = """
body{font-family:system-ui,sans-serif;max-width:1200px;margin:1em auto;padding:0 1em;color:#222}
code,pre{background:#f4f4f4;padding:2px 4px;white-space:pre-wrap;word-break:break-all}
table{border-collapse:collapse;font-size:12px;width:100%}th,td{border:1px solid #ddd;padding:3px 5px}
td.reason{overflow-wrap:anywhere;min-width:12em}summary{cursor:pointer}
th{background:#eee;cursor:pointer;position:sticky;top:0}tbody tr:nth-child(even){background:#fafafa}
.card{border:1px solid #ccc;border-radius:6px;padding:.5em 1em;margin:1em 0;background:#fcfcff}
"""
