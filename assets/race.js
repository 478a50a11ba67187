// The race (playground/race.py), replayed in the browser from the timings the server recorded
// and sent once with the compare panel: nothing goes to the server while it plays. The body of
// the panel's `js_on_load`: `element` is the panel (kept across values), `watch` calls back when
// Gradio sets a new value. A new value, a replay, Send, Enter or Regenerate ends the replay in
// progress; a page that asks for reduced motion shows the finished race until Replay is pressed.
let current = 0;  // the replay that may draw; each new start or end takes the next number
const lanesOf = (race) => ['eagle', 'plain'].map((name) => {
  const col = race.querySelector(`[data-lane="${name}"]`);
  return {name, col, toks: [...col.querySelector('.spec-answer').children]};
});
const show = (race) => {  // the finished state, as the server drew it
  current += 1;
  race.querySelectorAll('.race-hidden').forEach((t) => t.classList.remove('race-hidden'));
  race.classList.remove('playing');
};
const play = (race) => {
  const id = (current += 1);
  const data = JSON.parse(race.dataset.race);
  const lanes = lanesOf(race).map((l) => ({...l, ...data[l.name], i: 0, shown: 0}));
  const end = (l) => (l.t.length ? l.t[l.t.length - 1] : 0) + l.offset;
  for (const l of lanes) {
    l.toks.forEach((t) => t.classList.add('race-hidden'));
    l.col.classList.remove('done');
    delete l.col.dataset.doneAt;
    l.col.querySelector('.race-done').textContent = '';
  }
  delete race.dataset.order;
  race.classList.remove('finished');
  race.classList.add('playing');
  const clock = race.querySelector('.race-clock');
  const order = [];
  let start = null;
  const frame = (now) => {
    if (id !== current || !race.isConnected) return;
    start = start ?? now;
    const c = (now - start) / 1000;
    const done = [];
    for (const l of lanes) {
      while (l.i < l.t.length && l.t[l.i] + l.offset <= c) {
        for (; l.shown < l.n[l.i]; l.shown += 1) l.toks[l.shown].classList.remove('race-hidden');
        l.i += 1;
      }
      if (l.i === l.t.length && !l.col.classList.contains('done')) done.push(l);
    }
    done.sort((a, b) => end(a) - end(b));  // finishing in one frame: the earlier record first
    for (const l of done) {
      l.col.classList.add('done');
      l.col.dataset.doneAt = c.toFixed(3);
      l.col.querySelector('.race-done').textContent = ` · done at ${end(l).toFixed(2)} s`;
      order.push(l.name);
    }
    clock.textContent = `${c.toFixed(2)} s`;
    if (order.length === lanes.length) {  // the clock ends at the last recorded time
      clock.textContent = `${Math.max(...lanes.map(end)).toFixed(2)} s`;
      race.dataset.order = order.join(',');
      race.classList.replace('playing', 'finished');
      return;
    }
    requestAnimationFrame(frame);
  };
  requestAnimationFrame(frame);
};
const reduced = () => window.matchMedia('(prefers-reduced-motion: reduce)').matches;
element.addEventListener('click', (e) => {
  const button = e.target.closest('.race-play');
  if (button) play(button.closest('.race'));
});
const stop = () => { const race = element.querySelector('.race.playing'); if (race) show(race); };
document.addEventListener('click', (e) => {
  if (e.target.closest('#send, #regen, #race-btn')) stop();
}, true);
document.addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && !e.shiftKey && e.target.closest('#prompt')) stop();
}, true);
watch('value', () => {
  current += 1;
  requestAnimationFrame(() => {  // after the new value is drawn
    const race = element.querySelector('.race[data-race]');
    if (race && !reduced()) play(race);
  });
});
