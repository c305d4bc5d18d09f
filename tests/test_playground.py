"""The web playground (`GET /`) in a real browser: Debian's chromium driven by selenium, one browser for the
module, against real uvicorn servers on tiny seeded models. Talk: a fake microphone fed from an espeak-ng WAV
talks to the tiny Qwen3-Omni over /v1/realtime (under an API key the page asks for) and the page receives
audible audio, drawn as a waveform and a spectrogram; Speak: the tiny CustomVoice model's reply played in the
page is the PCM the API returns for the same seed; Clone: a voice saved from the page appears in
GET /v1/audio/voices. The page loads nothing from outside the server, and each tab's screenshot is saved
(to $OMNIMTP_SCREENSHOTS, e.g. docs/img to refresh the documentation's, else a temporary folder). The HTTP
checks that need no browser run first."""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
from audio_checks import assert_audible, spoken_wav
from server_harness import running_server
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.families.qwen3_tts import Qwen3TTSFamily
from omnimtp.server.app import create_app
from omnimtp.server.scheduler import Engine
from omnimtp.server.voice_store import VoiceStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCREENSHOTS = os.environ.get("OMNIMTP_SCREENSHOTS") or os.path.join(tempfile.gettempdir(), "omnimtp-screenshots")
KEY = "sk-playground"
MAX_FRAMES = 8
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def _tts_app(kind: str, **options):
    torch.manual_seed(0)  # the tiny Base model's speech-tokenizer encoder takes some initial weights from it
    engine = Engine(Qwen3TTSFamily.tiny(0, kind), model_id=f"tts-{kind}", max_frames=MAX_FRAMES, max_batch_size=2)
    return create_app(engine, **options)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    omni = create_app(Engine(Qwen3OmniFamily.tiny(0), max_frames=MAX_FRAMES, max_batch_size=2), api_key=KEY)
    urls = {}
    with running_server(omni) as urls["omni"], running_server(_tts_app("custom_voice")) as urls["speak"], \
            running_server(_tts_app("base", voice_store=VoiceStore(tmp_path_factory.mktemp("voices")),
                                    max_ref_seconds=4.0)) as urls["clone"], \
            running_server(_tts_app("voice_design")) as urls["design"]:
        yield urls


# -- without a browser -------------------------------------------------------------------------------------


def test_the_page_and_its_files_are_served_and_can_be_turned_off(servers):
    url = servers["speak"]
    for path in ("/", "/playground"):
        page = httpx.get(url + path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert "/playground/app.js" in page.text and "http" not in page.text  # nothing from elsewhere
    assert httpx.get(url + "/playground/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(url + "/playground/style.css").headers["content-type"].startswith("text/css")
    guarded = ("content-security-policy", "x-content-type-options", "cache-control")
    page_headers = {name: httpx.get(url + "/").headers[name] for name in guarded}
    assert page_headers["x-content-type-options"] == "nosniff" and page_headers["cache-control"] == "no-cache"
    for asset in ("app.js", "style.css"):  # the page's script and style carry the page's headers
        headers = httpx.get(f"{url}/playground/{asset}").headers
        assert {name: headers.get(name) for name in guarded} == page_headers, asset
    missing = httpx.get(url + "/playground/secret.py")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "no playground file 'secret.py'"
    # under --api-key the page itself is public (it asks for the key); the API is not
    assert httpx.get(servers["omni"] + "/").status_code == 200
    assert httpx.get(servers["omni"] + "/v1/models").status_code == 401
    engine = Engine(Qwen3TTSFamily.tiny(0, "custom_voice"), max_frames=MAX_FRAMES)
    with running_server(create_app(engine, playground=False)) as off:
        assert httpx.get(off + "/").status_code == 404 and httpx.get(off + "/playground/app.js").status_code == 404


def test_a_websocket_takes_the_key_as_a_subprotocol_and_echoes_realtime(servers):
    """A browser cannot set headers on a WebSocket: the key comes as `openai-insecure-api-key.KEY` (OpenAI's
    convention), and the server answers with "realtime", which the browser requires among those it offered."""
    ws_url = servers["omni"].replace("http", "ws") + "/v1/realtime"
    with connect(ws_url, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as socket:
        assert socket.subprotocol == "realtime"
        assert '"session.created"' in socket.recv(timeout=30)
    for protocols in (["realtime", "openai-insecure-api-key.wrong"], ["realtime"]):
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url, subprotocols=protocols)
        assert refused.value.response.status_code == 401


# -- in the browser ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def microphone(tmp_path_factory):
    """What the fake microphone hears: espeak-ng saying a sentence, then a minute of silence (Chromium loops
    the file; the silence ends the turn for server VAD and keeps the loop from barging in on the reply)."""
    folder = tmp_path_factory.mktemp("mic")
    said, rate = sf.read(spoken_wav(folder / "said.wav", "Hello, can you hear me?"), dtype="int16")
    path = folder / "speech.wav"
    sf.write(path, np.concatenate([said, np.zeros(60 * rate, dtype=np.int16)]), rate, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def browser(microphone, tmp_path_factory):
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 "--window-size=1100,900", "--autoplay-policy=no-user-gesture-required",
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                 f"--use-file-for-fake-audio-capture={microphone}",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _open(browser, url: str) -> None:
    browser.get(url + "/")
    _wait(browser, "return document.body.dataset.ready === 'true' || !document.getElementById('key-form').hidden")


def _wait(browser, script: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = browser.execute_script(script)
        if value:
            return value
        time.sleep(0.1)
    errors = browser.execute_script("return window.playground && window.playground.lastError")
    raise AssertionError(f"timed out waiting for {script!r}; the page's last error: {errors!r}")


def _click(browser, element_id: str) -> None:
    browser.find_element("id", element_id).click()


def _played(browser, tab: str) -> np.ndarray:
    data = browser.execute_script(f"return int16ToBase64(Int16Array.from(playground.played.{tab}))")
    return np.frombuffer(base64.b64decode(data), dtype="<i2")


def _assert_drawn(browser, tab: str) -> None:
    """The newest reply's waveform and spectrogram canvases are drawn (many distinct pixel values)."""
    for kind in ("canvas:not(.spectrogram)", "canvas.spectrogram"):
        values = browser.execute_script(
            f"const c = document.querySelector('#{tab}-replies .reply {kind}');"
            "return new Set(c.getContext('2d').getImageData(0, 0, c.width, c.height).data).size")
        assert values > 8, (tab, kind, values)


def _assert_only_local(browser, url: str) -> None:
    """Every resource the page loaded came from the server, and the browser logged no error but the 4xx answers
    the tests asked for (network entries of the server's own URLs)."""
    entries = browser.execute_script(
        "return performance.getEntriesByType('navigation').concat(performance.getEntriesByType('resource'))"
        ".map(e => e.name)")
    assert entries and all(name.startswith(url + "/") or name.startswith("blob:" + url) for name in entries), entries
    severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"
              and not (entry["source"] == "network" and entry["message"].startswith(url + "/v1/"))]
    assert severe == [], severe


def _screenshot(browser, tab: str) -> None:
    os.makedirs(SCREENSHOTS, exist_ok=True)
    assert browser.save_screenshot(os.path.join(SCREENSHOTS, f"playground-{tab}.png"))


def test_speak_plays_the_pcm_the_api_returns_for_the_same_seed(browser, servers):
    from selenium.webdriver.support.ui import Select

    url = servers["speak"]
    _open(browser, url)
    assert browser.find_element("id", "tab-clone").get_attribute("hidden") is not None  # not a Base model
    voices = httpx.get(url + "/v1/models").json()["data"][0]["voices"]
    chosen = browser.find_element("id", "speak-voice").get_attribute("value")
    assert chosen == voices[0]
    browser.find_element("id", "speak-seed").send_keys("7")
    _click(browser, "speak-go")
    _wait(browser, "return document.querySelector('#speak-replies a[download]')")
    played = _played(browser, "speak")
    reply = httpx.post(url + "/v1/audio/speech", timeout=120, json={
        "model": "tts-custom_voice", "input": "Hello! This is how I sound.", "voice": chosen, "language": "auto",
        "response_format": "pcm", "seed": 7})
    assert reply.status_code == 200, reply.text
    expected = np.frombuffer(reply.content, dtype="<i2")
    assert_audible(expected.astype(np.float32) / 32768)
    np.testing.assert_array_equal(played, expected)
    assert browser.find_element("id", "speak-latency").text.endswith("ms")
    _assert_drawn(browser, "speak")
    _screenshot(browser, "speak")
    # a compressed format plays too: the page decodes the whole file (the browser's own decoder)
    for count, fmt in enumerate(("mp3", "opus"), start=2):
        Select(browser.find_element("id", "speak-format")).select_by_value(fmt)
        _click(browser, "speak-go")
        _wait(browser, f"return document.querySelectorAll('#speak-replies a[download]').length === {count}")
        decoded = _played(browser, "speak")
        assert_audible(decoded.astype(np.float32) / 32768)
        assert abs(len(decoded) - len(expected)) < 0.1 * 24_000, (fmt, len(decoded), len(expected))
    Select(browser.find_element("id", "speak-format")).select_by_value("wav")
    # the server's words for a bad request are the page's
    browser.find_element("id", "speak-text").clear()
    browser.find_element("id", "speak-text").send_keys(" ")
    _click(browser, "speak-go")
    error = _wait(browser, "const e = document.getElementById('speak-error'); return !e.hidden && e.textContent")
    assert error == "input: empty text (nothing to speak)"
    _assert_only_local(browser, url)


def test_the_instructions_field_shows_only_where_the_model_takes_them(browser, servers):
    """VoiceDesign reads instructions (the voice, in words): the field is shown, and what is typed is spoken. The
    tiny CustomVoice (0.6B) and Base models would refuse them: no field."""
    for name, shown in (("speak", False), ("clone", False), ("design", True)):
        _open(browser, servers[name])
        assert browser.find_element("id", "speak").is_displayed(), name
        assert browser.find_element("id", "speak-instructions-label").is_displayed() == shown, name
    browser.find_element("id", "speak-instructions").send_keys("A calm, low voice.")
    _click(browser, "speak-go")
    _wait(browser, "return document.querySelector('#speak-replies a[download]')")
    assert browser.find_element("id", "speak-error").get_attribute("hidden") is not None
    assert_audible(_played(browser, "speak").astype(np.float32) / 32768)
    _assert_only_local(browser, servers["design"])


def test_clone_saves_a_voice_that_the_api_lists(browser, servers, tmp_path):
    url = servers["clone"]
    _open(browser, url)
    _click(browser, "tab-speak")  # before any voice is saved a Base model speaks in its default voice
    assert browser.find_element("id", "speak-voice").get_attribute("value") == ""
    _click(browser, "speak-go")
    _wait(browser, "return document.querySelector('#speak-replies a[download]')")
    assert_audible(_played(browser, "speak").astype(np.float32) / 32768)
    _click(browser, "tab-clone")
    t = np.arange(48_000) / 24_000
    reference = tmp_path / "reference.wav"
    sf.write(reference, (0.3 * np.sin(2 * np.pi * 150 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(
        np.float32), 24_000, subtype="PCM_16")
    _click(browser, "clone-save")  # no consent, no recording: the server says what is missing
    error = _wait(browser, "const e = document.getElementById('clone-error'); return !e.hidden && e.textContent")
    assert error.startswith("consent: required")
    name = browser.find_element("id", "clone-name")
    name.clear()
    name.send_keys("narrator")
    browser.find_element("id", "clone-file").send_keys(str(reference))
    browser.find_element("id", "clone-transcript").send_keys("A steady reference tone.")
    browser.find_element("id", "clone-consent").send_keys("I recorded this myself and agree to its cloning.")
    _click(browser, "clone-save")
    _wait(browser, "return document.querySelector('#clone-voices li[data-voice=\"narrator\"]')")
    listed = httpx.get(url + "/v1/audio/voices").json()["uploaded_voices"]
    assert [(voice["name"], voice["mode"]) for voice in listed] == [("narrator", "icl")]
    assert browser.find_element("id", "clone-error").get_attribute("hidden") is not None
    _screenshot(browser, "clone")
    # speak with it from the Speak tab
    browser.find_element("css selector", "#clone-voices li[data-voice='narrator'] button").click()
    assert browser.find_element("id", "speak-voice").get_attribute("value") == "narrator"
    _click(browser, "speak-go")
    _wait(browser, "return document.querySelectorAll('#speak-replies a[download]').length === 2")
    assert_audible(_played(browser, "speak").astype(np.float32) / 32768)
    _assert_only_local(browser, url)


def test_talk_hears_the_fake_microphone_and_plays_an_audible_reply(browser, servers):
    url = servers["omni"]
    _open(browser, url)
    assert browser.find_element("id", "key-form").is_displayed()  # under --api-key the page asks once
    browser.find_element("id", "key-input").send_keys(KEY)
    _click(browser, "key-submit")
    _wait(browser, "return document.body.dataset.ready === 'true'")
    assert browser.execute_script("return sessionStorage.getItem('omnimtp-api-key')") == KEY
    _click(browser, "talk-connect")
    # server VAD (the session's default) finds the turn: no button to press, the reply starts by itself
    _wait(browser, "return document.getElementById('talk-mode').textContent.startsWith('Server voice detection')")
    assert browser.find_element("id", "talk-record").get_attribute("disabled") is not None
    _wait(browser, "return document.body.dataset.talkDone === '1'")
    assert browser.find_element("id", "talk-error").get_attribute("hidden") is not None, \
        browser.find_element("id", "talk-error").text
    assert_audible(_played(browser, "talk").astype(np.float32) / 32768)
    assert browser.find_element("id", "talk-latency").text.endswith("ms")
    _assert_drawn(browser, "talk")
    assert browser.find_element("css selector", "#talk-replies .transcript").text != ""
    _assert_only_local(browser, url)
    _screenshot(browser, "talk")
