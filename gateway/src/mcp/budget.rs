//! Every tool result and progress notification within `--mcp-max-result-kb`, measured as
//! the client receives it: the serialized JSON-RPC message, with JSON escaping and base64
//! counted. Clients refuse larger messages outright (the official Python SDK drops any
//! Streamable HTTP event over 1 MiB, and the model then gets nothing), and a model's
//! context is better spent on a head, a tail and a note than on megabytes of output.
//!
//! What does not fit: a text keeps its head and its tail, with a note in the middle saying
//! how much was left out and how to read all of it; an image (or any other binary block)
//! is kept only when it fits whole, and a note where it was names its type and size (one
//! note for neighbours left out together). No I/O here.

use rmcp::model::{CallToolResult, ContentBlock};

/// Room kept for what surrounds a result or a notification on the wire: the JSON-RPC
/// envelope (`{"jsonrpc":"2.0","id":…,"result":…}`), the SSE framing and a progress token.
pub const ENVELOPE: usize = 1024;

/// The largest message a client is sent, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    limit: usize,
}

impl Budget {
    /// Smallest budget that leaves room for notes and a useful head and tail.
    pub const MIN_KIB: usize = 16;

    pub fn from_kib(kib: usize) -> Self {
        Budget {
            limit: kib.max(Self::MIN_KIB) * 1024,
        }
    }

    pub fn kib(&self) -> usize {
        self.limit / 1024
    }

    /// Bytes a result or notification may take, the envelope set aside.
    pub fn room(&self) -> usize {
        self.limit - ENVELOPE
    }

    /// `result`, changed only if it does not fit.
    pub fn fit(&self, mut result: CallToolResult) -> CallToolResult {
        let room = self.room();
        if json_size(&result) <= room {
            return result;
        }
        let blocks = merge_texts(std::mem::take(&mut result.content));
        // The fixed part (isError, structuredContent, the brackets) and a comma per block.
        let avail = room.saturating_sub(json_size(&result) + blocks.len());
        let binary: usize = blocks
            .iter()
            .filter(|b| b.as_text().is_none())
            .map(block_size)
            .sum();
        // Text gets what binary blocks do not need, and at least half when both compete.
        let mut text_cap = if binary == 0 {
            avail
        } else {
            (avail / 2).max(avail.saturating_sub(binary + NOTE_ROOM))
        };
        let mut max_binary = usize::MAX;
        for _ in 0..16 {
            let (content, kept) = self.assemble(&blocks, text_cap, max_binary, avail);
            let mut fitted = result.clone();
            fitted.content = content;
            if json_size(&fitted) <= room {
                return fitted;
            }
            // Notes took more than foreseen: give up binary blocks first, then text.
            if kept > 0 {
                max_binary = kept - (kept / 4).max(1);
            } else {
                text_cap /= 2;
            }
        }
        // Thousands of small outputs: one text for all the texts, one note for the rest.
        let texts: Vec<&str> = blocks
            .iter()
            .filter_map(|b| b.as_text().map(|t| t.text.as_str()))
            .collect();
        let binary: Vec<&ContentBlock> = blocks.iter().filter(|b| b.as_text().is_none()).collect();
        let mut content = vec![ContentBlock::text(cut(
            &texts.join("\n"),
            avail.saturating_sub(2 * NOTE_ROOM),
            self.kib(),
        ))];
        if !binary.is_empty() {
            content.push(note(&binary, self.kib()));
        }
        result.content = content;
        result
    }

    /// The content with texts cut to `text_cap` bytes in all, then binary blocks in order
    /// while they fit (at most `max_binary` of them); also how many binary blocks it kept.
    fn assemble<'a>(
        &self,
        blocks: &'a [ContentBlock],
        text_cap: usize,
        max_binary: usize,
        avail: usize,
    ) -> (Vec<ContentBlock>, usize) {
        let texts: Vec<&str> = blocks
            .iter()
            .filter_map(|b| b.as_text().map(|t| t.text.as_str()))
            .collect();
        let sizes: Vec<usize> = texts.iter().map(|t| json_len(t)).collect();
        let shares = shares(
            &sizes,
            text_cap.saturating_sub(texts.len() * TEXT_BLOCK_OVERHEAD),
        );
        let cut_texts: Vec<String> = texts
            .iter()
            .zip(shares)
            .map(|(text, share)| cut(text, share, self.kib()))
            .collect();
        let text_used: usize = cut_texts
            .iter()
            .map(|t| json_len(t) + TEXT_BLOCK_OVERHEAD)
            .sum();
        // Binary blocks take what texts leave, with room kept for the notes of those left
        // out: inline for the first few runs of them, one more note at the end for the rest.
        let mut free = avail.saturating_sub(text_used + NOTE_ROOM);
        let mut cut_texts = cut_texts.into_iter();
        let mut out = Vec::with_capacity(blocks.len());
        let mut run: Vec<&ContentBlock> = Vec::new();
        let mut later: Vec<&ContentBlock> = Vec::new();
        let mut notes = 0;
        let mut kept = 0;
        let kib = self.kib();
        let mut flush = |out: &mut Vec<ContentBlock>, run: &mut Vec<&'a ContentBlock>| {
            if run.is_empty() {
                return;
            }
            if notes < MAX_NOTES {
                out.push(note(run, kib));
                notes += 1;
                run.clear();
            } else {
                later.append(run);
            }
        };
        for block in blocks {
            if block.as_text().is_some() {
                flush(&mut out, &mut run);
                out.extend(cut_texts.next().map(ContentBlock::text));
                continue;
            }
            let size = block_size(block);
            if kept < max_binary && size <= free {
                flush(&mut out, &mut run);
                free -= size;
                kept += 1;
                out.push(block.clone());
            } else {
                if run.is_empty() {
                    free = free.saturating_sub(NOTE_ROOM);
                }
                run.push(block);
            }
        }
        flush(&mut out, &mut run);
        if !later.is_empty() {
            out.push(note(&later, self.kib()));
        }
        (out, kept)
    }

    /// A progress message that fits a notification (with `token_len` bytes of progress
    /// token), cut like a text when it does not.
    pub fn fit_message(&self, message: String, token_len: usize) -> String {
        // `{"progressToken":…,"progress":…,"message":"…"}` and the method name.
        let room = self.room().saturating_sub(token_len + 128);
        if json_len(&message) <= room {
            return message;
        }
        cut(&message, room, self.kib())
    }
}

/// `{"type":"text","text":""}` and a comma.
const TEXT_BLOCK_OVERHEAD: usize = 28;
/// Most bytes a note about left-out blocks takes.
const NOTE_ROOM: usize = 640;
/// Notes placed where their blocks were; blocks left out after these share one at the end.
const MAX_NOTES: usize = 8;

/// Merges neighbouring text blocks (the budget is shared between fewer, longer texts).
fn merge_texts(blocks: Vec<ContentBlock>) -> Vec<ContentBlock> {
    let mut out: Vec<ContentBlock> = Vec::with_capacity(blocks.len());
    for block in blocks {
        if let (Some(text), Some(ContentBlock::Text(last))) = (block.as_text(), out.last_mut()) {
            if !last.text.ends_with('\n') {
                last.text.push('\n');
            }
            last.text.push_str(&text.text);
            continue;
        }
        out.push(block);
    }
    out
}

/// Shares `cap` between texts of these sizes: those under an even share keep their size,
/// the others split what remains evenly.
fn shares(sizes: &[usize], cap: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| sizes[i]);
    let mut out = vec![0; sizes.len()];
    let mut left = cap;
    for (n, &i) in order.iter().enumerate() {
        let even = left / (sizes.len() - n);
        out[i] = sizes[i].min(even);
        left -= out[i];
    }
    out
}

/// The note that stands for binary blocks left out.
fn note(left_out: &[&ContentBlock], kib: usize) -> ContentBlock {
    let described: Vec<String> = left_out
        .iter()
        .take(8)
        .map(|b| format!("{}, {}", kind_of(b), human(block_size(b))))
        .collect();
    let more = match left_out.len() {
        n if n > 8 => format!(" and {} more", n - 8),
        _ => String::new(),
    };
    let what = match left_out.len() {
        1 => "1 image".to_owned(),
        n => format!("{n} images"),
    };
    ContentBlock::text(format!(
        "[{what} left out ({}{more}): a tool result holds at most {kib} KiB \
         (--mcp-max-result-kb). Show fewer figures per call, or smaller ones (e.g. \
         plt.figure(figsize=(5, 3), dpi=72)).]",
        described.join("; ")
    ))
}

fn kind_of(block: &ContentBlock) -> String {
    match block {
        ContentBlock::Image(i) => i.mime_type.clone(),
        ContentBlock::Audio(a) => a.mime_type.clone(),
        ContentBlock::Resource(_) => "a file".to_owned(),
        _ => "a block".to_owned(),
    }
}

/// Bytes as people read them.
fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{:.1} MB", b as f64 / f64::from(1 << 20)),
        b if b >= 1 << 10 => format!("{} KB", b >> 10),
        b => format!("{b} bytes"),
    }
}

/// `text` within `max` bytes of JSON string content: its head and tail around a note.
pub fn cut(text: &str, max: usize, kib: usize) -> String {
    if json_len(text) <= max {
        return text.to_owned();
    }
    let note = |omitted: &str| {
        let lines = omitted.matches('\n').count();
        format!(
            "[... {} bytes ({lines} lines) left out here: tool results are limited to \
             {kib} KiB (--mcp-max-result-kb). To see all of it, have run_python write it \
             to a file, then read that with read_file's offset and length ...]\n",
            omitted.len()
        )
    };
    // The note with the largest numbers it can hold, to size the rest.
    // Plus the newline that may go before it (two bytes as JSON).
    let keep = max.saturating_sub(json_len(&note(text)) + 2);
    let head_max = keep / 2;
    let tail_max = keep - head_max;
    let mut head = 0;
    let mut size = 0;
    for (i, c) in text.char_indices() {
        size += char_json_len(c);
        if size > head_max {
            break;
        }
        head = i + c.len_utf8();
    }
    let mut tail = text.len();
    size = 0;
    for (i, c) in text.char_indices().rev() {
        size += char_json_len(c);
        if size > tail_max || i < head {
            break;
        }
        tail = i;
    }
    // End the head and start the tail at line breaks when one is near.
    if let Some(nl) = text[..head].rfind('\n') {
        if head - nl <= head_max / 5 {
            head = nl + 1;
        }
    }
    if let Some(nl) = text[tail..].find('\n') {
        if nl < tail_max / 5 {
            tail += nl + 1;
        }
    }
    let tail = tail.max(head);
    let gap = if head == 0 || text[..head].ends_with('\n') {
        ""
    } else {
        "\n"
    };
    format!(
        "{}{gap}{}{}",
        &text[..head],
        note(&text[head..tail]),
        &text[tail..]
    )
}

/// Bytes of `text` inside a JSON string, as serde_json escapes it.
pub fn json_len(text: &str) -> usize {
    text.chars().map(char_json_len).sum()
}

/// Bytes of one character inside a JSON string.
pub fn char_json_len(c: char) -> usize {
    match c {
        '"' | '\\' | '\n' | '\r' | '\t' | '\u{8}' | '\u{c}' => 2,
        c if (c as u32) < 0x20 => 6,
        c => c.len_utf8(),
    }
}

fn json_size<T: serde::Serialize>(value: &T) -> usize {
    serde_json::to_vec(value).map_or(usize::MAX, |v| v.len())
}

fn block_size(block: &ContentBlock) -> usize {
    json_size(block)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> Budget {
        Budget::from_kib(64)
    }

    fn fits(result: &CallToolResult, budget: Budget) -> bool {
        json_size(result) <= budget.room()
    }

    #[test]
    fn json_len_counts_escapes() {
        let text = "a\"\\\n\u{1}é😀";
        let quoted = serde_json::to_string(text).expect("serializes");
        assert_eq!(json_len(text), quoted.len() - 2);
    }

    #[test]
    fn a_small_result_is_unchanged() {
        let result = CallToolResult::success(vec![ContentBlock::text("hi")]);
        assert_eq!(budget().fit(result.clone()), result);
    }

    #[test]
    fn a_long_text_keeps_head_and_tail_with_a_note() {
        let text: String = (0..100_000).map(|i| format!("line {i}\n")).collect();
        let result = budget().fit(CallToolResult::success(vec![ContentBlock::text(
            text.clone(),
        )]));
        assert!(fits(&result, budget()));
        let out = &result.content[0].as_text().expect("text").text;
        assert!(out.starts_with("line 0\nline 1\n"), "{}", &out[..50]);
        assert!(out.ends_with("line 99999\n"));
        assert!(out.contains("left out here"));
        assert!(out.contains("read_file's offset and length"));
        // It uses most of the budget, and says how much it left out.
        assert!(out.len() > budget().room() * 9 / 10, "{}", out.len());
        let (head, rest) = out.split_once("[... ").expect("a note");
        let (_, tail) = rest.split_once(" ...]\n").expect("the note's end");
        assert!(text.starts_with(head) && text.ends_with(tail));
        let omitted = text.len() - head.len() - tail.len();
        assert!(
            rest.starts_with(&format!("{omitted} bytes")),
            "{omitted}: {rest:.80}"
        );
    }

    #[test]
    fn escapes_count_against_the_budget() {
        // Each control character takes six bytes as JSON.
        let text = "\u{1}".repeat(60_000);
        let result = budget().fit(CallToolResult::success(vec![ContentBlock::text(text)]));
        assert!(fits(&result, budget()));
    }

    #[test]
    fn images_that_fit_stay_and_a_note_stands_for_the_others() {
        let image = |n: usize| ContentBlock::image("A".repeat(n), "image/png");
        let result = budget().fit(CallToolResult::success(vec![
            ContentBlock::text("before"),
            image(40_000),
            image(40_000),
            image(30_000),
            ContentBlock::text("after"),
            image(10_000),
        ]));
        assert!(fits(&result, budget()));
        let kinds: Vec<&str> = result
            .content
            .iter()
            .map(|b| match b {
                ContentBlock::Image(_) => "image",
                ContentBlock::Text(t) if t.text.contains("left out") => "note",
                _ => "text",
            })
            .collect();
        assert_eq!(kinds, ["text", "image", "note", "text", "image"]);
        let note = &result.content[2].as_text().expect("a note").text;
        assert!(
            note.starts_with("[2 images left out (image/png, 39 KB; image/png, 29 KB)"),
            "{note}"
        );
    }

    #[test]
    fn text_and_images_share_the_budget() {
        let text = "x".repeat(200_000);
        let result = budget().fit(CallToolResult::success(vec![
            ContentBlock::text(text),
            ContentBlock::image("A".repeat(20_000), "image/png"),
        ]));
        assert!(fits(&result, budget()));
        assert!(result.content.iter().any(|b| b.as_image().is_some()));
        assert!(result.content[0]
            .as_text()
            .is_some_and(|t| t.text.contains("left out")));
    }

    #[test]
    fn many_blocks_still_fit() {
        let mut blocks = Vec::new();
        for i in 0..2_000 {
            blocks.push(ContentBlock::text(format!("output {i}")));
            blocks.push(ContentBlock::image("A".repeat(100), "image/png"));
        }
        let result = budget().fit(CallToolResult::success(blocks));
        assert!(fits(&result, budget()), "{}", json_size(&result));
    }

    #[test]
    fn a_progress_message_fits_a_notification() {
        let message = "y".repeat(200_000);
        let out = budget().fit_message(message, 40);
        assert!(json_len(&out) <= budget().room());
        assert!(out.starts_with("yyy") && out.ends_with("yyy") && out.contains("left out"));
    }

    #[test]
    fn shares_are_even_for_the_large() {
        assert_eq!(shares(&[10, 1000, 1000], 510), [10, 250, 250]);
        assert_eq!(shares(&[10, 20], 100), [10, 20]);
    }
}
