// A tap (or click) on a token or a speed tile shows its details, its `title`, in a popover
// below it: touch screens never show a title (playground/layout.py). A tap elsewhere, a
// scroll or Escape hides it. Run once at page load.
() => {
    const tip = document.createElement('div');
    tip.id = 'tap-details';
    tip.setAttribute('role', 'tooltip');
    tip.hidden = true;
    document.body.append(tip);
    const hide = () => { tip.hidden = true; };
    document.addEventListener('click', (e) => {
        const item = e.target instanceof Element && e.target.closest('.tok[title], .tile[title]');
        if (!item || !item.title) { hide(); return; }
        tip.textContent = item.title;
        tip.hidden = false;
        const r = item.getBoundingClientRect(), margin = 8;
        const left = Math.min(r.left, window.innerWidth - tip.offsetWidth - margin);
        const below = r.bottom + 6 + tip.offsetHeight <= window.innerHeight;
        tip.style.left = `${Math.max(margin, left) + window.scrollX}px`;
        tip.style.top = `${(below ? r.bottom + 6 : r.top - 6 - tip.offsetHeight)
                          + window.scrollY}px`;
    });
    document.addEventListener('scroll', hide, true);
    document.addEventListener('keydown', (e) => { if (e.key === 'Escape') hide(); });
}
