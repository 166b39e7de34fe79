//! Output text as a terminal would show it, for readers that are not terminals (a
//! language model): escape sequences removed, and each line in the final state its
//! redraws left it in.
//!
//! Kernels send what programs write: IPython colours tracebacks with ANSI SGR sequences,
//! and progress bars (tqdm, pip, `print(..., end='\r')`) redraw one line over and over with
//! `\r`. A terminal shows the last frame; the raw text holds every frame. [`Terminal`]
//! keeps the state of the line being drawn, so chunks can be fed as they arrive (a stream
//! message may end in the middle of an escape sequence or of a redrawn line), and
//! [`plain_text`] does a whole text at once.
//!
//! What is interpreted: `\n` ends a line (`\r\n` too: the carriage return only moves the
//! cursor); `\r` moves to the start of the line, `\b` one column back, and later
//! characters overwrite; CSI `K` (erase in line), `G`, `C` and `D` (cursor column) act on
//! the line. Every other escape sequence (CSI, OSC up to BEL or ST, DCS/SOS/PM/APC strings,
//! two-character and nF escapes, C1 controls) and every other control character but `\t`
//! is dropped. A column is one character (wide characters are not measured). A line that
//! was redrawn loses its trailing spaces (the padding bars write over longer frames).
//!
//! Reference: ECMA-48 (control functions), xterm's "Control Sequences" document.

/// Where the escape-sequence parser stands between two characters.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Escape {
    /// Plain text.
    None,
    /// After ESC.
    Start,
    /// ESC and intermediates (0x20-0x2F), waiting for the final byte.
    Intermediate,
    /// A control sequence: ESC `[` (or C1 CSI), its parameter bytes so far.
    Csi(String),
    /// A string (OSC, DCS, SOS, PM, APC) up to BEL or ST; `true` right after an ESC in it.
    Str(bool),
}

/// Longest parameter string of a control sequence that is kept (the rest is ignored).
const MAX_PARAMS: usize = 32;

/// The state of a terminal fed one stream's text in chunks.
#[derive(Debug, Clone)]
pub struct Terminal {
    escape: Escape,
    /// The line being drawn (no `\n` yet).
    line: String,
    /// Byte offset of the cursor in `line`, on a character boundary.
    cursor: usize,
    /// The line was drawn over (a character overwritten or erased).
    redrawn: bool,
}

impl Default for Terminal {
    fn default() -> Self {
        Self::new()
    }
}

impl Terminal {
    pub fn new() -> Self {
        Terminal {
            escape: Escape::None,
            line: String::new(),
            cursor: 0,
            redrawn: false,
        }
    }

    /// Feeds a chunk; returns the lines it completed, each with its `\n`, in their final
    /// state. The line still being drawn stays here ([`Self::pending`]).
    pub fn push(&mut self, chunk: &str) -> String {
        let mut done = String::new();
        for c in chunk.chars() {
            self.feed(c, &mut done);
        }
        done
    }

    /// The line being drawn, as it stands now.
    pub fn pending(&self) -> &str {
        if self.redrawn {
            self.line.trim_end_matches(' ')
        } else {
            &self.line
        }
    }

    /// Ends the text: the unfinished line in its final state (an incomplete escape
    /// sequence at the end is dropped). The terminal is empty again afterwards.
    pub fn finish(&mut self) -> String {
        let last = self.pending().to_owned();
        *self = Terminal::new();
        last
    }

    fn feed(&mut self, c: char, done: &mut String) {
        match std::mem::replace(&mut self.escape, Escape::None) {
            Escape::None => self.print(c, done),
            Escape::Start => match c {
                '[' => self.escape = Escape::Csi(String::new()),
                ']' | 'P' | 'X' | '^' | '_' => self.escape = Escape::Str(false),
                ' '..='/' => self.escape = Escape::Intermediate,
                '0'..='~' => {}
                // Not a sequence after all: the ESC is dropped, the character is text.
                _ => self.print(c, done),
            },
            Escape::Intermediate => match c {
                ' '..='/' => self.escape = Escape::Intermediate,
                '0'..='~' => {}
                _ => self.print(c, done),
            },
            Escape::Csi(mut params) => match c {
                // Parameter and intermediate bytes.
                ' '..='?' => {
                    if params.len() < MAX_PARAMS {
                        params.push(c);
                    }
                    self.escape = Escape::Csi(params);
                }
                '@'..='~' => self.control(c, &params),
                // A malformed sequence ends here; the character is text.
                _ => self.print(c, done),
            },
            Escape::Str(after_esc) => match c {
                '\u{7}' | '\u{9c}' => {}
                '\\' if after_esc => {}
                '\u{1b}' => self.escape = Escape::Str(true),
                // ESC and something else: the string was cut short by a new sequence.
                _ if after_esc => {
                    self.escape = Escape::Start;
                    self.feed(c, done);
                }
                _ => self.escape = Escape::Str(false),
            },
        }
    }

    /// A character outside any escape sequence.
    fn print(&mut self, c: char, done: &mut String) {
        match c {
            '\n' => {
                done.push_str(self.pending());
                done.push('\n');
                self.line.clear();
                self.cursor = 0;
                self.redrawn = false;
            }
            '\r' => self.cursor = 0,
            '\u{8}' => {
                if let Some(prev) = self.line[..self.cursor].chars().next_back() {
                    self.cursor -= prev.len_utf8();
                }
            }
            '\u{1b}' => self.escape = Escape::Start,
            '\u{9b}' => self.escape = Escape::Csi(String::new()),
            '\u{90}' | '\u{98}' | '\u{9d}' | '\u{9e}' | '\u{9f}' => {
                self.escape = Escape::Str(false)
            }
            '\t' => self.write(c),
            c if c.is_control() => {}
            c => self.write(c),
        }
    }

    /// Writes a character at the cursor, over whatever is there.
    fn write(&mut self, c: char) {
        if self.cursor == self.line.len() {
            self.line.push(c);
        } else {
            let old = self.line[self.cursor..]
                .chars()
                .next()
                .map_or(0, char::len_utf8);
            let mut buf = [0; 4];
            self.line
                .replace_range(self.cursor..self.cursor + old, c.encode_utf8(&mut buf));
            self.redrawn = true;
        }
        self.cursor += c.len_utf8();
    }

    /// The end of a control sequence: the few that change the line act, others are dropped.
    fn control(&mut self, last: char, params: &str) {
        // Private (`?25l`) and intermediate-byte sequences never touch the line.
        if params.chars().any(|p| !p.is_ascii_digit() && p != ';') {
            return;
        }
        let n = params
            .split(';')
            .next()
            .and_then(|p| p.parse::<usize>().ok());
        match last {
            // Erase in line: 0 to the end, 1 to the start, 2 all of it.
            'K' => {
                match n.unwrap_or(0) {
                    0 => self.line.truncate(self.cursor),
                    1 => {
                        let upto = self.line[self.cursor..]
                            .chars()
                            .next()
                            .map_or(self.cursor, |c| self.cursor + c.len_utf8());
                        let blank = " ".repeat(self.line[..upto].chars().count());
                        self.cursor = self.cursor + blank.len() - upto;
                        self.line.replace_range(..upto, &blank);
                    }
                    2 => {
                        let blank = " ".repeat(self.line.chars().count());
                        let column = self.line[..self.cursor].chars().count();
                        self.line = blank;
                        self.cursor = column;
                    }
                    _ => return,
                }
                self.redrawn = true;
            }
            // Cursor to a column (1-based).
            'G' => self.move_to(n.unwrap_or(1).max(1) - 1),
            // Cursor forward / back.
            'C' => {
                let column = self.line[..self.cursor].chars().count();
                self.move_to(column + n.unwrap_or(1).max(1));
            }
            'D' => {
                let column = self.line[..self.cursor].chars().count();
                self.move_to(column.saturating_sub(n.unwrap_or(1).max(1)));
            }
            _ => {}
        }
    }

    /// Puts the cursor at a column, padding the line with spaces when it is shorter.
    fn move_to(&mut self, column: usize) {
        // Bounded: a sequence cannot make the line grow without end.
        let column = column.min(self.line.len() + 1024);
        let count = self.line.chars().count();
        if column >= count {
            self.line.push_str(&" ".repeat(column - count));
            self.cursor = self.line.len();
            if column > count {
                self.redrawn = true;
            }
        } else {
            self.cursor = self
                .line
                .char_indices()
                .nth(column)
                .map_or(self.line.len(), |(i, _)| i);
        }
    }
}

/// A whole text as a terminal shows it (see the module's documentation).
pub fn plain_text(text: &str) -> String {
    let mut terminal = Terminal::new();
    let mut out = terminal.push(text);
    out.push_str(&terminal.finish());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colours_and_other_sequences_are_dropped() {
        assert_eq!(
            plain_text("\u{1b}[0;31mZeroDivisionError\u{1b}[0m: division by zero"),
            "ZeroDivisionError: division by zero"
        );
        // OSC 8 hyperlink (ST-terminated) and a title (BEL-terminated): the text stays.
        assert_eq!(
            plain_text(
                "\u{1b}]8;;https://x.org\u{1b}\\link\u{1b}]8;;\u{1b}\\ \u{1b}]0;title\u{7}ok"
            ),
            "link ok"
        );
        // Charset selection (nF), keypad mode (Fp), a private CSI, C1 CSI, DCS.
        assert_eq!(
            plain_text("\u{1b}(Ba\u{1b}=b\u{1b}[?25lc\u{9b}1md\u{1b}Pq#0\u{1b}\\e"),
            "abcde"
        );
        assert_eq!(plain_text("bell\u{7} del\u{7f} nul\u{0}"), "bell del nul");
        assert_eq!(plain_text("cut \u{1b}"), "cut ");
        assert_eq!(plain_text("cut \u{1b}[3"), "cut ");
        assert_eq!(plain_text("tab\tstays"), "tab\tstays");
    }

    #[test]
    fn a_redrawn_line_keeps_its_last_frame() {
        let frames: String = (0..=100)
            .step_by(10)
            .map(|p| format!("\r{p:3}%|{:<10}|", "#".repeat(p / 10)))
            .collect();
        assert_eq!(
            plain_text(&format!("{frames}\ndone\n")),
            "100%|##########|\ndone\n"
        );
        // Overwriting a longer frame keeps its tail, as a terminal does...
        assert_eq!(plain_text("abcdef\rXY"), "XYcdef");
        // ...unless the line is erased first; padding spaces go.
        assert_eq!(plain_text("abcdef\r\u{1b}[KXY"), "XY");
        assert_eq!(plain_text("long frame\rshort     \n"), "short\n");
        // A bar cleared at its end (tqdm leave=False) leaves nothing.
        assert_eq!(plain_text("50%\r   \r"), "");
        assert_eq!(plain_text("ab\u{8}\u{8}XY"), "XY");
        assert_eq!(plain_text("abc\u{1b}[2K\u{1b}[1Gz"), "z");
        assert_eq!(plain_text("abc\u{1b}[2D\u{1b}[1K-"), " -c");
        assert_eq!(plain_text("a\u{1b}[3Cb"), "a   b");
    }

    #[test]
    fn crlf_is_a_newline_and_plain_text_is_unchanged() {
        assert_eq!(plain_text("one\r\ntwo\r\n"), "one\ntwo\n");
        let text = "plain text, ünïcödé 😀\n\n  indented  \nlast";
        assert_eq!(plain_text(text), text);
    }

    #[test]
    fn chunks_split_anywhere_give_the_same_text() {
        let text = "\u{1b}[31mred\u{1b}[0m\n 10%\r 20%\r100%\ndone\r\n\u{1b}]0;t\u{1b}\\x";
        let whole = plain_text(text);
        let chars: Vec<char> = text.chars().collect();
        for cut in 0..=chars.len() {
            let (a, b): (String, String) =
                (chars[..cut].iter().collect(), chars[cut..].iter().collect());
            let mut t = Terminal::new();
            let mut out = t.push(&a);
            out += &t.push(&b);
            out += &t.finish();
            assert_eq!(out, whole, "cut at {cut}");
        }
    }

    #[test]
    fn pending_is_the_line_being_drawn() {
        let mut t = Terminal::new();
        assert_eq!(t.push(" 10%\r 50%"), "");
        assert_eq!(t.pending(), " 50%");
        assert_eq!(t.push("\r100%\nnext"), "100%\n");
        assert_eq!(t.pending(), "next");
        assert_eq!(t.finish(), "next");
        assert_eq!(t.pending(), "");
    }
}
