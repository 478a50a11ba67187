// The race (playground/race.py), replayed in the browser from the timings the server recorded
// and sent once with the compare panel: nothing goes to the server while it plays. The body of
// the panel's `js_on_load`: `element` is the panel (kept across values), `watch` calls back when
// Gradio sets a new value. The server draws the race finished but `waiting`; a new race plays
// from the start, or, on a page that asks for reduced motion, shows finished until Replay is
// pressed. Its outcome (the verdict, the result, each side's stats and finish, the measured
// speedup in the tiles) is hidden while it waits or plays (assets/style.css) and shows when both
// sides have finished, or when a new value, Send, Enter, Regenerate or Race ends the replay in
// progress (`show`). The clock is the race's: recorded seconds, advancing at 1×, 2× or 4× the
// recorded pace as chosen beside Replay; a change mid-replay goes on from the clock's time, and
// the choice holds for the next races.
let current = 0;  // the replay that may draw; each new start or end takes the next number
let speed = 1;  // the chosen multiple of the recorded pace
const lanesOf = (race) => ['eagle', 'plain'].map((name) => {
  const col = race.querySelector(`[data-lane="${name}"]`);
  return {name, col, toks: [...col.querySelector('.spec-answer').children]};
});
// a lane of the race's data: when it ends on the race's clock; the clock's text at the end
const end = (lane) => (lane.t.length ? lane.t[lane.t.length - 1] : 0) + lane.offset;
const endText = (lanes) => `${Math.max(...lanes.map(end)).toFixed(2)} s`;
const markSpeed = (race) => race.querySelectorAll('.race-speed [data-speed]').forEach((b) => {
  b.setAttribute('aria-pressed', String(Number(b.dataset.speed) === speed));
});
const show = (race) => {  // the finished state, as the server drew it
  current += 1;
  race.querySelectorAll('.race-hidden').forEach((t) => t.classList.remove('race-hidden'));
  race.querySelectorAll('[data-lane]').forEach((col) => col.classList.add('done'));
  race.querySelector('.race-clock').textContent = endText(Object.values(
    JSON.parse(race.dataset.race)));
  race.classList.remove('waiting', 'playing');
};
const play = (race) => {
  const id = (current += 1);
  const data = JSON.parse(race.dataset.race);
  const lanes = lanesOf(race).map((l) => ({...l, ...data[l.name], i: 0, shown: 0}));
  for (const l of lanes) {  // its "done at" stays as drawn, hidden while the race plays
    l.toks.forEach((t) => t.classList.add('race-hidden'));
    l.col.classList.remove('done');
    delete l.col.dataset.doneAt;
  }
  delete race.dataset.order;
  race.classList.remove('waiting', 'finished');
  race.classList.add('playing');
  const clock = race.querySelector('.race-clock');
  clock.textContent = '0.00 s';
  const order = [];
  let c = 0;  // the race's clock: recorded seconds
  let last = null;  // the frame time the clock was last advanced at
  const frame = (now) => {
    if (id !== current || !race.isConnected) return;
    c += last === null ? 0 : ((now - last) / 1000) * speed;
    last = now;
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
      order.push(l.name);
    }
    clock.textContent = `${c.toFixed(2)} s`;
    if (order.length === lanes.length) {  // the clock ends at the last recorded time
      clock.textContent = endText(lanes);
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
  const choice = e.target.closest('.race-speed [data-speed]');
  if (choice) {  // a replay in progress reads it at its next frame
    speed = Number(choice.dataset.speed);
    markSpeed(choice.closest('.race'));
  }
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
    if (!race) return;
    markSpeed(race);
    if (reduced()) show(race);
    else play(race);
  });
});
