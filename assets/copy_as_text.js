// Copying an answer copies its text (playground/layout.py says why); run once at page load.
() => {
    const tokens = (s) => s.includes('class="tok ');
    const text = (node) => {  // the answer as read: rejected drafts out, entities decoded
        node.querySelectorAll('.tok-rej').forEach((e) => e.remove());
        return node.textContent;
    };
    const clean = (s) => tokens(s)
        ? text(new DOMParser().parseFromString(s, 'text/html').body) : s;
    if (navigator.clipboard) {
        const write = navigator.clipboard.writeText.bind(navigator.clipboard);
        navigator.clipboard.writeText = (s) => write(clean(s));
    }
    document.addEventListener('copy', (e) => {
        const box = e.target, sel = document.getSelection();
        let out = null;
        if (box instanceof HTMLTextAreaElement && tokens(box.value)) out = clean(box.value);
        else if (sel.rangeCount && ['#chat', '#compare-out'].some(
                (id) => document.querySelector(id)?.contains(sel.anchorNode))) {
            const div = document.createElement('div');
            div.append(sel.getRangeAt(0).cloneContents());
            if (div.querySelector('.tok-rej')) out = text(div);
        }
        if (out !== null) { e.clipboardData.setData('text/plain', out); e.preventDefault(); }
    }, true); }
