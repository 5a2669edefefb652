// Plain DOM and SVG building blocks: tables, a line chart, a histogram. No charting dependency; the
// server already downsampled whatever reaches here, so a few thousand points at most.
import { Json } from './api';

const SVG = 'http://www.w3.org/2000/svg';

export function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  cls?: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

export function svg(tag: string, attrs: Record<string, string | number> = {}): SVGElement {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) {
    node.setAttribute(k, String(v));
  }
  return node;
}

export function formatBytes(n: number): string {
  if (!Number.isFinite(n)) {
    return String(n);
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = Math.abs(n);
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${n < 0 ? '-' : ''}${i === 0 ? v : v.toFixed(2)} ${units[i]}`;
}

export function formatValue(v: Json, column = ''): string {
  if (v === null || v === undefined) {
    return '';
  }
  if (typeof v === 'number') {
    if (/bytes/.test(column) && Number.isInteger(v)) {
      return formatBytes(v);
    }
    return Number.isInteger(v) ? String(v) : v.toPrecision(6);
  }
  if (Array.isArray(v)) {
    return v.length <= 8 && v.every(x => typeof x !== 'object') ? `[${v.join(', ')}]` : `[${v.length} items]`;
  }
  if (typeof v === 'object') {
    return JSON.stringify(v).slice(0, 120);
  }
  return String(v);
}

/** Rows as records, whether the server sent records or {column: values}. */
export function asRecords(data: Json): Record<string, Json>[] {
  if (Array.isArray(data)) {
    return data.map(r => (r !== null && typeof r === 'object' ? r : { value: r }));
  }
  if (data && typeof data === 'object') {
    const cols = Object.keys(data).filter(k => Array.isArray(data[k]));
    if (cols.length) {
      const n = Math.max(...cols.map(c => data[c].length));
      return Array.from({ length: n }, (_, i) => Object.fromEntries(cols.map(c => [c, data[c][i]])));
    }
  }
  return [];
}

/** One numeric column, from records or from {column: values}. */
export function column(data: Json, name: string): number[] {
  if (data && !Array.isArray(data) && Array.isArray(data[name])) {
    return data[name].map(Number);
  }
  return asRecords(data).map(r => Number(r[name]));
}

/** How a table shows its columns' names and its cells, where a view wants other than the raw name and
 * formatValue (the checkpoint tab: labels in words, dotted keys that break after their dots). */
export interface ITableFormat {
  className?: string;
  header?: (col: string) => string;
  cell?: (td: HTMLTableCellElement, value: Json, col: string) => void;
}

export function table(
  rows: Record<string, Json>[],
  columns?: string[],
  onRowClick?: (row: Record<string, Json>, tr: HTMLTableRowElement) => void,
  bytesColumns: string[] = [],
  fmt: ITableFormat = {}
): HTMLTableElement {
  const cols = columns ?? Array.from(new Set(rows.flatMap(r => Object.keys(r))));
  const t = el('table', fmt.className ?? 'pw-table');
  const head = t.createTHead().insertRow();
  for (const c of cols) {
    head.appendChild(el('th', undefined, fmt.header ? fmt.header(c) : c));
  }
  const body = t.createTBody();
  for (const r of rows) {
    const tr = body.insertRow();
    for (const c of cols) {
      const td = tr.insertCell();
      td.dataset.col = c;
      if (fmt.cell) {
        fmt.cell(td, r[c], c);
      } else {
        td.textContent = formatValue(r[c], bytesColumns.includes(c) ? 'bytes' : c);
      }
      if (typeof r[c] === 'number') {
        td.className = 'pw-num';
      }
    }
    if (onRowClick) {
      tr.classList.add('pw-clickable');
      tr.addEventListener('click', () => onRowClick(r, tr));
    }
  }
  return t;
}

/** Any JSON object as nested key/value tables: for results whose exact shape may grow (verify, diff). */
export function jsonView(value: Json, depth = 0, hint = ''): HTMLElement {
  if (value === null || typeof value !== 'object') {
    return el('span', 'pw-scalar', formatValue(value, hint));
  }
  if (Array.isArray(value)) {
    if (value.length && value.every(v => v && typeof v === 'object' && !Array.isArray(v))) {
      const box = el('div');
      box.appendChild(table(value.slice(0, 200)));
      if (value.length > 200) {
        box.appendChild(el('div', 'pw-note', `first 200 of ${value.length} rows`));
      }
      return box;
    }
    return el('span', 'pw-scalar', formatValue(value));
  }
  const t = el('table', 'pw-table pw-kv');
  for (const [k, v] of Object.entries(value)) {
    const tr = t.insertRow();
    tr.appendChild(el('th', undefined, k));
    const td = tr.insertCell();
    // Under a "..._bytes" key, every number is a byte count (max_rank_bytes: {parameter: ...}).
    const h = /bytes/.test(k) ? k : hint || k;
    td.appendChild(depth < 3 ? jsonView(v, depth + 1, h) : el('span', undefined, formatValue(v, h)));
  }
  return t;
}

/** The step of 1, 2 or 5 times a power of ten that cuts `span` into at most about `target` intervals
 * (workbench.ticks.nice_step: the memory tab's axes come from the server, the other charts use this). */
function niceStep(span: number, target = 5): number {
  if (!(Number.isFinite(span) && span > 0)) {
    return 1;
  }
  const raw = span / Math.max(1, target);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 5, 10]) {
    if (m * power >= raw * (1 - 1e-9)) {
      return m * power;
    }
  }
  return 10 * power;
}

/** A multiple of `step` with the decimals the step needs, trailing zeros dropped. */
function tickLabel(v: number, step: number): string {
  const d = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  const text = v.toFixed(d).replace(/(\.\d*?)0+$/, '$1').replace(/\.$/, '');
  return Number(text) === 0 ? '0' : text;
}

function multiples(lo: number, hi: number, step: number): number[] {
  const out: number[] = [];
  for (let k = Math.ceil(lo / step - 1e-9); k <= Math.floor(hi / step + 1e-9); k++) {
    out.push(k * step);
  }
  return out;
}

export interface ISeries {
  name: string;
  x: number[];
  y: number[];
  /** Its colour, where it has a meaning (default: the k-th line's). */
  color?: string;
}

/** A line chart of one or more series sharing the x axis; drag to select an x window. */
export function lineChart(
  series: ISeries[],
  options: {
    title?: string;
    xLabel?: string;
    /** y values are bytes: ticks in one binary unit (MiB, GiB), 1-2-5 steps. */
    yBytes?: boolean;
    onSelect?: (x0: number, x1: number) => void;
    width?: number;
    height?: number;
  } = {}
): HTMLElement {
  const W = options.width ?? 720;
  const H = options.height ?? 240;
  const m = { l: 80, r: 16, t: 24, b: 36 };
  const box = el('div', 'pw-chart');
  const root = svg('svg', { viewBox: `0 0 ${W} ${H}`, width: W, height: H }) as SVGSVGElement;
  box.appendChild(root);
  const xs = series.flatMap(s => s.x).filter(Number.isFinite);
  const ys = series.flatMap(s => s.y).filter(Number.isFinite);
  if (options.title) {
    const t = svg('text', { x: m.l, y: 16, class: 'pw-chart-title' });
    t.textContent = options.title;
    root.appendChild(t);
  }
  if (!xs.length || !ys.length) {
    const t = svg('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle' });
    t.textContent = 'no data';
    root.appendChild(t);
    return box;
  }
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) {
    x1 = x0 + 1;
  }
  if (y0 === y1) {
    y1 = y0 + 1;
  }
  if (y0 > 0 && y0 / y1 < 0.5) {
    y0 = 0;
  }
  // 1-2-5 ticks: y widened to whole steps (in one binary unit for bytes), x ticks inside the data's range
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  let scale = 1;
  let unit = '';
  if (options.yBytes) {
    let k = 0;
    while (Math.max(Math.abs(y0), Math.abs(y1)) / scale >= 1024 && k < units.length - 1) {
      scale *= 1024;
      k++;
    }
    unit = ` ${units[k]}`;
  }
  const ystep = niceStep((y1 - y0) / scale, 4);
  y0 = Math.floor(y0 / scale / ystep + 1e-9) * ystep * scale;
  y1 = Math.ceil(y1 / scale / ystep - 1e-9) * ystep * scale;
  const xstep = niceStep(x1 - x0, 5);
  const sx = (x: number) => m.l + ((x - x0) / (x1 - x0)) * (W - m.l - m.r);
  const sy = (y: number) => H - m.b - ((y - y0) / (y1 - y0)) * (H - m.t - m.b);
  root.appendChild(svg('line', { x1: m.l, y1: H - m.b, x2: W - m.r, y2: H - m.b, class: 'pw-axis' }));
  root.appendChild(svg('line', { x1: m.l, y1: m.t, x2: m.l, y2: H - m.b, class: 'pw-axis' }));
  for (const v of multiples(y0 / scale, y1 / scale, ystep)) {
    const ty = svg('text', { x: m.l - 4, y: sy(v * scale) + 4, 'text-anchor': 'end', class: 'pw-tick pw-ytick', 'data-value': v * scale });
    ty.textContent = tickLabel(v, ystep) + unit;
    root.appendChild(ty);
  }
  for (const xv of multiples(x0, x1, xstep)) {
    const tx = svg('text', { x: sx(xv), y: H - m.b + 14, 'text-anchor': 'middle', class: 'pw-tick pw-xtick', 'data-value': xv });
    tx.textContent = tickLabel(xv, xstep);
    root.appendChild(tx);
  }
  if (options.xLabel) {
    const t = svg('text', { x: (W + m.l) / 2, y: H - 4, 'text-anchor': 'middle', class: 'pw-tick' });
    t.textContent = options.xLabel;
    root.appendChild(t);
  }
  series.forEach((s, k) => {
    const pts: string[] = [];
    for (let i = 0; i < s.x.length; i++) {
      if (Number.isFinite(s.x[i]) && Number.isFinite(s.y[i])) {
        pts.push(`${sx(s.x[i]).toFixed(1)},${sy(s.y[i]).toFixed(1)}`);
      }
    }
    const line = svg('polyline', { points: pts.join(' '), class: `pw-line pw-line-${k % 6}` });
    if (s.color) {
      line.style.stroke = s.color; // a colour with a meaning (the palette's total), not the k-th line's
    }
    root.appendChild(line);
  });
  if (series.length > 1) {
    const legend = el('div', 'pw-legend-box');
    series.forEach((s, k) => legend.appendChild(el('span', `pw-legend-item pw-swatch-${k % 6}`, s.name)));
    box.appendChild(legend);
  }
  if (options.onSelect) {
    attachXBrush(root, W, m, H - m.t - m.b, [x0, x1], sx, options.onSelect);
  }
  return box;
}

/** Drag across a chart's plot area (``W`` wide in viewBox units, margins ``m``, plot ``plotH`` high, x
 * ``domain`` drawn by ``sx``) to select an x window: a band follows the drag, ``onSelect(a, b)`` gets the
 * window in data units (the server then re-downsamples it). */
export function attachXBrush(
  root: SVGSVGElement | SVGElement,
  W: number,
  m: { l: number; r: number; t: number },
  plotH: number,
  domain: [number, number],
  sx: (x: number) => number,
  onSelect: (a: number, b: number) => void
): void {
  const [x0, x1] = domain;
  const band = svg('rect', { y: m.t, height: plotH, width: 0, class: 'pw-band' });
  root.appendChild(band);
  const toX = (ev: MouseEvent) => {
    const r = root.getBoundingClientRect();
    const px = ((ev.clientX - r.left) / r.width) * W;
    return x0 + ((Math.min(Math.max(px, m.l), W - m.r) - m.l) / (W - m.l - m.r)) * (x1 - x0);
  };
  let start: number | null = null;
  root.addEventListener('mousedown', ev => {
    start = toX(ev as MouseEvent);
  });
  root.addEventListener('mousemove', ev => {
    if (start !== null) {
      const x = toX(ev as MouseEvent);
      const a = sx(Math.min(start, x));
      band.setAttribute('x', String(a));
      band.setAttribute('width', String(sx(Math.max(start, x)) - a));
    }
  });
  root.addEventListener('mouseup', ev => {
    if (start !== null) {
      const x = toX(ev as MouseEvent);
      const [a, b] = [Math.min(start, x), Math.max(start, x)];
      start = null;
      if (b > a) {
        onSelect(a, b);
      }
    }
  });
}

/** A histogram from bin edges (n+1) and counts (n). ``logCount``: bar heights on a log10(1 + count) axis,
 * so a few sparse bins beside a full one still show; ``xLabel``: what x is (``x``, ``log10 |x|``). */
export function histogram(
  edges: number[],
  counts: number[],
  title = 'histogram',
  options: { logCount?: boolean; xLabel?: string } = {}
): HTMLElement {
  const W = 480;
  const H = options.xLabel ? 194 : 180;
  const m = { l: 48, r: 8, t: 20, b: options.xLabel ? 44 : 30 };
  const box = el('div', 'pw-chart');
  const root = svg('svg', { viewBox: `0 0 ${W} ${H}`, width: W, height: H, 'data-count-scale': options.logCount ? 'log' : 'linear' });
  box.appendChild(root);
  const t = svg('text', { x: m.l, y: 14, class: 'pw-chart-title' });
  t.textContent = title;
  root.appendChild(t);
  const n = counts.length;
  const top = Math.max(1, ...counts);
  const scale = options.logCount ? (c: number) => Math.log10(1 + c) / Math.log10(1 + top) : (c: number) => c / top;
  const bw = (W - m.l - m.r) / Math.max(1, n);
  counts.forEach((c, i) => {
    const h = scale(c) * (H - m.t - m.b);
    root.appendChild(svg('rect', { x: m.l + i * bw, y: H - m.b - h, width: Math.max(1, bw - 1), height: h, class: 'pw-bar' }));
  });
  if (edges.length) {
    for (const [x, v, a] of [[m.l, edges[0], 'start'], [W - m.r, edges[edges.length - 1], 'end']] as const) {
      const tx = svg('text', { x, y: H - m.b + 14, 'text-anchor': a, class: 'pw-tick' });
      tx.textContent = Number(v).toPrecision(4);
      root.appendChild(tx);
    }
  }
  if (options.xLabel) {
    const tx = svg('text', { x: (m.l + W - m.r) / 2, y: H - 6, 'text-anchor': 'middle', class: 'pw-tick pw-axis-label' });
    tx.textContent = options.xLabel;
    root.appendChild(tx);
  }
  const ty = svg('text', { x: m.l - 4, y: m.t + 8, 'text-anchor': 'end', class: 'pw-tick' });
  ty.textContent = top.toLocaleString('en-US');
  root.appendChild(ty);
  if (options.logCount) {
    const tl = svg('text', { x: m.l - 4, y: m.t + 20, 'text-anchor': 'end', class: 'pw-tick' });
    tl.textContent = 'log';
    root.appendChild(tl);
  }
  return box;
}

export interface IGanttBar {
  row: number;
  start: number;
  end: number;
  /** Colour index (a microbatch). */
  group: number;
  /** A colour of its own instead of the group's (a step timeline's category). */
  color?: string;
  label: string;
  /** Drawn lighter and hatched (a backward). */
  light?: boolean;
  tip?: string;
}

// The line charts' palette (style/index.css), inline here so the Gantt needs no stylesheet of its own.
const PALETTE = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b'];

/** A Gantt chart: one row per label, one bar per interval, x in the bars' unit (ms). */
export function gantt(rowLabels: string[], bars: IGanttBar[], options: { title?: string; xLabel?: string } = {}): HTMLElement {
  const W = 720;
  const rowH = 28;
  const m = { l: 120, r: 16, t: 24, b: 36 };
  const H = m.t + m.b + rowH * Math.max(1, rowLabels.length);
  const box = el('div', 'pw-chart pw-gantt');
  const root = svg('svg', { viewBox: `0 0 ${W} ${H}`, width: W, height: H });
  box.appendChild(root);
  if (options.title) {
    const t = svg('text', { x: m.l, y: 16, class: 'pw-chart-title' });
    t.textContent = options.title;
    root.appendChild(t);
  }
  const x1 = Math.max(1e-9, ...bars.map(b => b.end));
  const sx = (x: number) => m.l + (x / x1) * (W - m.l - m.r);
  rowLabels.forEach((label, i) => {
    const t = svg('text', { x: m.l - 6, y: m.t + rowH * i + rowH / 2 + 4, 'text-anchor': 'end', class: 'pw-tick pw-gantt-row' });
    t.textContent = label;
    root.appendChild(t);
  });
  root.appendChild(svg('line', { x1: m.l, y1: H - m.b, x2: W - m.r, y2: H - m.b, class: 'pw-axis' }));
  for (let i = 0; i <= 4; i++) {
    const xv = (x1 * i) / 4;
    const tx = svg('text', { x: sx(xv), y: H - m.b + 14, 'text-anchor': 'middle', class: 'pw-tick' });
    tx.textContent = String(Number(xv.toPrecision(3)));
    root.appendChild(tx);
  }
  if (options.xLabel) {
    const t = svg('text', { x: (W + m.l) / 2, y: H - 4, 'text-anchor': 'middle', class: 'pw-tick' });
    t.textContent = options.xLabel;
    root.appendChild(t);
  }
  for (const b of bars) {
    const x = sx(b.start);
    const w = Math.max(1, sx(b.end) - x);
    const y = m.t + rowH * b.row + 3;
    const g = svg('g', { class: 'pw-gantt-bar', 'data-row': b.row, 'data-label': b.label });
    const r = svg('rect', {
      x,
      y,
      width: w,
      height: rowH - 6,
      fill: b.color ?? PALETTE[b.group % PALETTE.length],
      'fill-opacity': b.light ? 0.55 : 1,
      stroke: 'white',
      'stroke-width': 0.5
    });
    if (b.tip) {
      const title = svg('title');
      title.textContent = b.tip;
      r.appendChild(title);
    }
    g.appendChild(r);
    if (w > 18) {
      const t = svg('text', { x: x + w / 2, y: y + rowH / 2 + 1, 'text-anchor': 'middle', 'font-size': 10, fill: 'white' });
      t.textContent = b.label;
      g.appendChild(t);
    }
    root.appendChild(g);
  }
  return box;
}
