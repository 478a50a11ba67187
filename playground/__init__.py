"""The EAGLE-3 Playground's web app, beside `app.py` (which only starts it): start-up, the
page's layout, the event handlers, and drawing answers, trees, tiles and the race. It uses the
engine (`eagle_engine`); the engine never imports it."""
